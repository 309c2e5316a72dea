//! Randomized stress of DeviceBuffer / PinnedBuffer copies on the host backend, against a
//! sequential model: copies between random pairs on random streams (chains across streams,
//! event-ordered reads through raw pointers), host reads and writes, buffers replaced while
//! work is pending (dropped, freed, or dropped inside a job) and streams replaced.
//!
//! Rules: every read-back and the final contents equal the sequential model; a run that does
//! not finish in 20 s is a hang, reported with its seed. `CUFERRY_STRESS_ITERS` and
//! `CUFERRY_STRESS_SEED` pick the seeds.
mod common;

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::stress::{self, pause};
use common::Rng;
use cuferry::{copy_range, Device, DeviceBuffer, Event, PinnedBuffer, Stream};

/// Seeds run by the test suite (a few seconds); `CUFERRY_STRESS_ITERS` runs more.
const DEFAULT_ITERS: u64 = 150;

enum Buf {
    Dev(DeviceBuffer<u32>),
    Pin(PinnedBuffer<u32>),
}

struct Slot {
    buf: Buf,
    model: Vec<u32>,
}

impl Buf {
    fn read(&self, stream: &Stream) -> Vec<u32> {
        match self {
            Buf::Dev(b) => b.to_vec(stream).unwrap(),
            Buf::Pin(b) => b.as_slice().unwrap().to_vec(),
        }
    }
}

fn new_buf(r: &mut Rng, stream: &Stream, len: usize) -> Slot {
    let data: Vec<u32> = (0..len).map(|_| r.next_u64() as u32).collect();
    let buf = match r.below(4) {
        0 => Buf::Dev(DeviceBuffer::from_slice(stream, &data).unwrap()),
        1 => {
            let b = DeviceBuffer::zeroed(stream, len).unwrap();
            return Slot { buf: Buf::Dev(b), model: vec![0; len] };
        }
        2 => Buf::Pin(PinnedBuffer::from_slice(Device::Host, &data).unwrap()),
        _ => {
            let b = PinnedBuffer::zeroed(Device::Host, len).unwrap();
            return Slot { buf: Buf::Pin(b), model: vec![0; len] };
        }
    };
    Slot { buf, model: data }
}

fn do_copy(stream: &Stream, src: &Buf, so: usize, dst: &mut Buf, d_o: usize, n: usize) {
    match (src, dst) {
        (Buf::Dev(s), Buf::Dev(d)) => copy_range(stream, s, so, d, d_o, n),
        (Buf::Dev(s), Buf::Pin(d)) => copy_range(stream, s, so, d, d_o, n),
        (Buf::Pin(s), Buf::Dev(d)) => copy_range(stream, s, so, d, d_o, n),
        (Buf::Pin(s), Buf::Pin(d)) => copy_range(stream, s, so, d, d_o, n),
    }
    .unwrap();
}

fn run_one(seed: u64) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let nstreams = 1 + rng.below(4);
    let nbufs = 2 + rng.below(5);
    let threads = 1 + rng.below(3);
    let ops = 5 + rng.below(60);
    let len = 1 + rng.below(2048);
    let streams: Arc<Mutex<Vec<Stream>>> =
        Arc::new(Mutex::new((0..nstreams).map(|_| Stream::new(Device::Host).unwrap()).collect()));
    let s0 = streams.lock().unwrap()[0].clone();
    let bufs: Arc<Vec<Mutex<Slot>>> =
        Arc::new((0..nbufs).map(|_| Mutex::new(new_buf(&mut rng, &s0, len))).collect());
    let errors = Arc::new(Mutex::new(Vec::<String>::new()));
    let outstanding = Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let (done_tx, done_rx) = mpsc::channel::<()>();
    for t in 0..threads {
        let bufs = Arc::clone(&bufs);
        let streams = Arc::clone(&streams);
        let errors = Arc::clone(&errors);
        let outstanding = Arc::clone(&outstanding);
        let done = done_tx.clone();
        let mut r = Rng::new(seed ^ ((t as u64 + 5) * 0x0101_7777_abcd));
        std::thread::spawn(move || {
            for op in 0..ops {
                pause(&mut r);
                let stream = {
                    let v = streams.lock().unwrap();
                    v[r.below(v.len())].clone()
                };
                let a = r.below(nbufs);
                match r.below(10) {
                    0..=4 => {
                        let mut b = r.below(nbufs - 1);
                        if b >= a {
                            b += 1;
                        }
                        let (lo, hi) = (a.min(b), a.max(b));
                        let g_lo = bufs[lo].lock().unwrap();
                        let g_hi = bufs[hi].lock().unwrap();
                        let (mut gs, mut gd) = if a < b { (g_lo, g_hi) } else { (g_hi, g_lo) };
                        let n = r.below(len + 1);
                        let so = r.below(len - n + 1);
                        let d_o = r.below(len - n + 1);
                        let src_vals: Vec<u32> = gs.model[so..so + n].to_vec();
                        let src_buf = &gs.buf;
                        do_copy(&stream, src_buf, so, &mut gd.buf, d_o, n);
                        gd.model[d_o..d_o + n].copy_from_slice(&src_vals);
                        let _ = &mut gs;
                    }
                    5 => {
                        // host-side read check
                        let g = bufs[a].lock().unwrap();
                        let got = g.buf.read(&stream);
                        if got != g.model {
                            let first = got.iter().zip(&g.model).position(|(x, y)| x != y);
                            errors.lock().unwrap().push(format!("t{t} op{op}: buf {a} differs at {first:?}"));
                        }
                    }
                    6 => {
                        // host write
                        let mut g = bufs[a].lock().unwrap();
                        let data: Vec<u32> = (0..len).map(|_| r.next_u64() as u32).collect();
                        match &mut g.buf {
                            Buf::Dev(b) => b.copy_from_slice(&stream, &data).unwrap(),
                            Buf::Pin(b) => b.as_mut_slice().unwrap().copy_from_slice(&data),
                        }
                        g.model = data;
                    }
                    7 => {
                        // replace (drop while pending)
                        let mut g = bufs[a].lock().unwrap();
                        let fresh = new_buf(&mut r, &stream, len);
                        let old = std::mem::replace(&mut *g, fresh);
                        drop(g);
                        let k = r.below(3);
                        if k == 2 {
                            // dropped inside a job of some stream
                            let st = {
                                let v = streams.lock().unwrap();
                                v[r.below(v.len())].clone()
                            };
                            let holder = std::sync::Mutex::new(Some(old));
                            st.host_fn(move || drop(holder.lock().unwrap().take())).unwrap();
                        } else if k == 1 {
                            match old.buf {
                                Buf::Dev(b) => b.free().unwrap(),
                                Buf::Pin(b) => b.free().unwrap(),
                            }
                        } else {
                            drop(old);
                        }
                    }
                    8 if r.below(2) == 0 => {
                        // copy into a fresh buffer on S, record, T waits, T checks via pointer
                        let g = bufs[a].lock().unwrap();
                        let n = 1 + r.below(len);
                        let so = r.below(len - n + 1);
                        let want = g.model[so..so + n].to_vec();
                        let mut fresh = match r.below(2) {
                            0 => Buf::Dev(DeviceBuffer::zeroed(&stream, n).unwrap()),
                            _ => Buf::Pin(PinnedBuffer::zeroed(Device::Host, n).unwrap()),
                        };
                        do_copy(&stream, &g.buf, so, &mut fresh, 0, n);
                        drop(g);
                        let ev = Event::new(Device::Host).unwrap();
                        ev.record(&stream).unwrap();
                        let t_stream = {
                            let v = streams.lock().unwrap();
                            v[r.below(v.len())].clone()
                        };
                        t_stream.wait_event(&ev).unwrap();
                        if r.below(2) == 0 {
                            drop(ev);
                        }
                        let ptr = match &fresh {
                            Buf::Dev(b) => b.as_ptr() as usize,
                            Buf::Pin(b) => b.as_ptr() as usize,
                        };
                        let errors2 = Arc::clone(&errors);
                        let holder = Mutex::new(Some(fresh));
                        outstanding.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                        let out2 = Arc::clone(&outstanding);
                        t_stream
                            .host_fn(move || {
                                // SAFETY: `holder` keeps the buffer (n elements) alive until
                                // this job drops it, and the event wait orders this read after
                                // the copy that wrote it; nothing else writes it.
                                let got = unsafe { std::slice::from_raw_parts(ptr as *const u32, n) };
                                if got != &want[..] {
                                    errors2
                                        .lock()
                                        .unwrap()
                                        .push(format!("t{t} op{op}: event-ordered read saw stale data"));
                                }
                                drop(holder.lock().unwrap().take());
                                out2.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
                            })
                            .unwrap();
                    }
                    8 => {
                        // drop a stream (replace)
                        let mut v = streams.lock().unwrap();
                        let i = r.below(v.len());
                        v[i] = Stream::new(Device::Host).unwrap();
                    }
                    _ => {
                        // chain: copy a -> b on one stream then b -> c on another
                        if nbufs < 3 {
                            continue;
                        }
                        let mut idx = vec![a];
                        while idx.len() < 3 {
                            let x = r.below(nbufs);
                            if !idx.contains(&x) {
                                idx.push(x);
                            }
                        }
                        let mut sorted = idx.clone();
                        sorted.sort();
                        let mut guards: Vec<_> =
                            sorted.iter().map(|&i| (i, bufs[i].lock().unwrap())).collect();
                        let pos = |i: usize| sorted.iter().position(|&x| x == i).unwrap();
                        let stream2 = {
                            let v = streams.lock().unwrap();
                            v[r.below(v.len())].clone()
                        };
                        for (k, st) in [(0usize, &stream), (1, &stream2)] {
                            let (si, di) = (pos(idx[k]), pos(idx[k + 1]));
                            let n = r.below(len + 1);
                            let so = r.below(len - n + 1);
                            let d_o = r.below(len - n + 1);
                            let vals = guards[si].1.model[so..so + n].to_vec();
                            // split borrow
                            let (src, dst) = if si < di {
                                let (l, rr) = guards.split_at_mut(di);
                                (&l[si].1, &mut rr[0].1)
                            } else {
                                let (l, rr) = guards.split_at_mut(si);
                                (&rr[0].1, &mut l[di].1)
                            };
                            do_copy(st, &src.buf, so, &mut dst.buf, d_o, n);
                            dst.model[d_o..d_o + n].copy_from_slice(&vals);
                        }
                    }
                }
            }
            let _ = done.send(());
        });
    }
    drop(done_tx);
    let deadline = Instant::now() + Duration::from_secs(20);
    for i in 0..threads {
        if done_rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).is_err() {
            return Err(format!("HANG seed {seed}: {i}/{threads} threads done"));
        }
    }
    while outstanding.load(std::sync::atomic::Ordering::SeqCst) > 0 {
        if Instant::now() > deadline {
            return Err(format!("HANG seed {seed}: event-ordered checks never ran"));
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let mut errs = errors.lock().unwrap().clone();
    let st = Stream::new(Device::Host).unwrap();
    for (i, b) in bufs.iter().enumerate() {
        let g = b.lock().unwrap();
        let got = g.buf.read(&st);
        if got != g.model {
            let first = got.iter().zip(&g.model).position(|(x, y)| x != y);
            errs.push(format!("final buf {i} differs at {first:?}"));
        }
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(format!("seed {seed} S{nstreams} B{nbufs} T{threads} ops {ops} len {len}: {errs:?}"))
    }
}

#[test]
fn buffer_stress() {
    stress::run_seeds(DEFAULT_ITERS, run_one);
}
