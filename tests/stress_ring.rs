//! Randomized stress of the slot ring on the host backend: 1-4 producers (acquire, try and
//! timed acquire, produce, produce_timeout, abandoned slots, some dropped in jobs of other
//! streams) and 1-4 consumers (next, try and timed next, release, slots held or dropped in
//! jobs, delayed reads of a slot queued before its release), a close at a random point, and
//! a backend that fails submissions and orderings at random.
//!
//! Rules: every item whose publish returned Ok arrives exactly once and intact, nothing else
//! arrives, a failed produce published a prefix, each consumer sees each producer in order
//! (when no ordering failed), no slot is overwritten before its consumer's queued work ran,
//! and occupancy ends at 0. A run that does not finish in 20 s is reported as a hang with its
//! seed. `CUFERRY_STRESS_ITERS` and `CUFERRY_STRESS_SEED` pick the seeds (the default is a
//! short run for the test suite; thousands passed when written); `CUFERRY_STRESS_NO_FLAKY`
//! and `CUFERRY_STRESS_NO_BIG` turn off the failing backend and the 100-400 KB slots.
mod common;

use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::stress::{self, pause};
use common::Rng;
use cuferry::ring::{
    PackExecutor, RingOptions, SlotFill, SlotLayout, SlotMeta, SlotRing, StreamTransferBackend,
    TransferBackend, TransferCapabilities,
};
use cuferry::{Device, DeviceBuffer, Error, Stream};

/// Seeds run by the test suite (a few seconds); `CUFERRY_STRESS_ITERS` runs more.
const DEFAULT_ITERS: u64 = 150;

/// Fails submissions and stream orderings at random (seeded by call count).
struct Flaky {
    inner: StreamTransferBackend,
    seed: u64,
    calls: std::sync::atomic::AtomicU64,
    submit_rate: usize,
    wait_rate: usize,
}

impl Flaky {
    fn roll(&self, rate: usize) -> bool {
        if rate == 0 {
            return false;
        }
        let c = self.calls.fetch_add(1, Ordering::SeqCst);
        Rng::new(self.seed ^ c.wrapping_mul(0x9e37_79b9)).below(rate) == 0
    }
}

impl TransferBackend for Flaky {
    fn capabilities(&self) -> TransferCapabilities {
        self.inner.capabilities()
    }
    fn device(&self) -> Device {
        self.inner.device()
    }
    fn allocate_host_slots(&mut self, c: usize, b: usize) -> cuferry::Result<()> {
        self.inner.allocate_host_slots(c, b)
    }
    fn register_host_slots(&mut self, s: Vec<Vec<u8>>) -> cuferry::Result<()> {
        self.inner.register_host_slots(s)
    }
    fn allocate_device_slots(&mut self, c: usize, b: usize) -> cuferry::Result<()> {
        self.inner.allocate_device_slots(c, b)
    }
    fn host_slot_count(&self) -> usize {
        self.inner.host_slot_count()
    }
    fn device_slot_count(&self) -> usize {
        self.inner.device_slot_count()
    }
    fn slot_bytes(&self) -> usize {
        self.inner.slot_bytes()
    }
    unsafe fn host_slot_mut(&self, h: usize) -> cuferry::Result<&mut [u8]> {
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.host_slot_mut(h) }
    }
    fn wait_host_slot(&self, h: usize) -> cuferry::Result<()> {
        self.inner.wait_host_slot(h)
    }
    fn host_slot_idle(&self, h: usize) -> cuferry::Result<bool> {
        self.inner.host_slot_idle(h)
    }
    unsafe fn submit_upload(&self, h: usize, d: usize, b: usize) -> cuferry::Result<Duration> {
        if self.roll(self.submit_rate) {
            return Err(Error::Unsupported { what: "injected submit failure".into() });
        }
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.submit_upload(h, d, b) }
    }
    fn upload_device_ms(&self, d: usize) -> cuferry::Result<Option<f32>> {
        self.inner.upload_device_ms(d)
    }
    fn ready_query(&self, d: usize) -> cuferry::Result<bool> {
        self.inner.ready_query(d)
    }
    fn synchronize_ready(&self, d: usize) -> cuferry::Result<()> {
        self.inner.synchronize_ready(d)
    }
    fn wait_stream_for_ready(&self, d: usize, s: &Stream) -> cuferry::Result<()> {
        if self.roll(self.wait_rate) {
            return Err(Error::Unsupported { what: "injected wait failure".into() });
        }
        self.inner.wait_stream_for_ready(d, s)
    }
    fn release(&self, d: usize, s: &Stream) -> cuferry::Result<()> {
        self.inner.release(d, s)
    }
    fn device_slot(&self, d: usize) -> cuferry::Result<&DeviceBuffer<u8>> {
        self.inner.device_slot(d)
    }
    fn close(&self) -> cuferry::Result<()> {
        self.inner.close()
    }
}

fn payload(pid: u64, seq: u64, slot: usize) -> Vec<u8> {
    let mut r = Rng::new((pid << 40) ^ seq ^ 0x55);
    let len = 8 + r.below(slot - 7);
    let mut d = r.bytes(len);
    d[..8].copy_from_slice(&((pid << 32) | seq).to_le_bytes());
    d
}

#[derive(Default)]
struct Log {
    /// (pid, seq) published Ok
    published: Vec<(u64, u64)>,
    /// (consumer, pid, seq)
    received: Vec<(usize, u64, u64)>,
    errors: Vec<String>,
    /// produce() failed: (pid, lo, hi): some prefix of lo..hi was published
    uncertain: Vec<(u64, u64, u64)>,
}

fn run_one(seed: u64) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let depth = 1 + rng.below(5);
    let big = stress::mode("CUFERRY_STRESS_NO_BIG") && rng.below(4) == 0;
    let slot = if big { 100_000 + rng.below(300_000) } else { 8 + rng.below(256) };
    let shared_pool = Arc::new(PackExecutor::new(1 + rng.below(4)).unwrap());
    let use_shared = rng.below(2) == 0;
    let producers = 1 + rng.below(4);
    let consumers = 1 + rng.below(4);
    let items = rng.below(40) as u64;
    let close_early = rng.below(3) == 0;
    let flaky = stress::mode("CUFERRY_STRESS_NO_FLAKY") && rng.below(2) == 0;
    let ring = if flaky {
        let mut b = StreamTransferBackend::new(Device::Host, false).unwrap();
        b.allocate_host_slots(depth, slot).unwrap();
        b.allocate_device_slots(depth, slot).unwrap();
        let submit_rate = [0, 2, 3, 5, 8][rng.below(5)];
        let wait_rate = [0, 2, 3, 5, 8][rng.below(5)];
        SlotRing::with_backend(Box::new(Flaky {
            inner: b,
            seed,
            calls: Default::default(),
            submit_rate,
            wait_rate,
        }))
        .unwrap()
    } else {
        SlotRing::new(Device::Host, RingOptions::new(depth, slot)).map_err(|e| e.to_string())?
    };
    let log = Arc::new(Mutex::new(Log::default()));
    let bad = Arc::new(AtomicBool::new(false));
    let (done_tx, done_rx) = mpsc::channel::<&'static str>();
    let producers_left = Arc::new(AtomicUsize::new(producers));
    let shared_stream = Stream::new(Device::Host).unwrap();
    let all_streams: Arc<Mutex<Vec<Stream>>> = Arc::new(Mutex::new(vec![shared_stream.clone()]));

    for pid in 0..producers as u64 {
        let ring = ring.clone();
        let log = Arc::clone(&log);
        let done = done_tx.clone();
        let shared_pool = Arc::clone(&shared_pool);
        let left = Arc::clone(&producers_left);
        let all_streams = Arc::clone(&all_streams);
        let mut r = Rng::new(seed ^ (pid + 1).wrapping_mul(0x1234_5678_9abc));
        std::thread::spawn(move || {
            let own_pool = PackExecutor::new(1 + r.below(3)).unwrap();
            let pool: &PackExecutor = if use_shared { &shared_pool } else { &own_pool };
            let mut seq = 0u64;
            'outer: while seq < items {
                pause(&mut r);
                match r.below(6) {
                    0..=2 => {
                        let got = match r.below(3) {
                            0 => ring.acquire(),
                            1 => ring.acquire_timeout(Duration::from_micros(r.below(2000) as u64)),
                            _ => ring.try_acquire(),
                        };
                        match got {
                            Ok(mut s) => {
                                let data = payload(pid, seq, slot);
                                s.bytes_mut()[..data.len()].copy_from_slice(&data);
                                pause(&mut r);
                                if r.below(16) == 0 {
                                    drop(s); // abandon
                                } else if r.below(16) == 0 {
                                    let st = Stream::new(Device::Host).unwrap();
                                    all_streams.lock().unwrap().push(st.clone());
                                    st.host_fn(move || drop(s)).unwrap(); // abandon in a job
                                } else {
                                    let meta =
                                        SlotMeta::new((pid << 32) | seq, SlotLayout::bytes(data.len()));
                                    match s.publish(meta) {
                                        Ok(()) => log.lock().unwrap().published.push((pid, seq)),
                                        Err(Error::Closed { .. }) => break 'outer,
                                        Err(Error::Unsupported { .. }) if flaky => {}
                                        Err(e) => log.lock().unwrap().errors.push(format!("publish: {e}")),
                                    }
                                }
                                seq += 1;
                            }
                            Err(Error::Closed { .. }) => break 'outer,
                            Err(Error::Timeout { .. }) | Err(Error::WouldBlock { .. }) => {}
                            Err(e) => {
                                log.lock().unwrap().errors.push(format!("acquire: {e}"));
                                break 'outer;
                            }
                        }
                    }
                    k => {
                        let n = (1 + r.below(5) as u64).min(items - seq);
                        let datas: Vec<Vec<u8>> = (seq..seq + n).map(|s| payload(pid, s, slot)).collect();
                        let fills = datas
                            .iter()
                            .enumerate()
                            .map(|(i, d)| SlotFill::bytes((pid << 32) | (seq + i as u64), d));
                        let ahead = 1 + r.below(depth + 1);
                        let (count, res) = if k == 3 {
                            match ring.produce(pool, ahead, fills) {
                                Ok(c) => (c, Ok(())),
                                Err(e) => (u64::MAX, Err(e)),
                            }
                        } else {
                            let p = ring.produce_timeout(
                                pool,
                                ahead,
                                fills,
                                Duration::from_micros(r.below(3000) as u64),
                            );
                            (p.published, p.result)
                        };
                        match res {
                            Ok(()) => {
                                assert_eq!(count, n);
                                let mut l = log.lock().unwrap();
                                for s in seq..seq + n {
                                    l.published.push((pid, s));
                                }
                                seq += n;
                            }
                            Err(e) => {
                                if count == u64::MAX {
                                    // produce() with an error: a prefix of the batch went out.
                                    log.lock().unwrap().uncertain.push((pid, seq, seq + n));
                                    seq += n;
                                    match e {
                                        Error::Closed { .. } => break 'outer,
                                        Error::Unsupported { .. } if flaky => continue 'outer,
                                        e => {
                                            log.lock().unwrap().errors.push(format!("produce: {e}"));
                                            break 'outer;
                                        }
                                    }
                                }
                                let mut l = log.lock().unwrap();
                                for s in seq..seq + count {
                                    l.published.push((pid, s));
                                }
                                drop(l);
                                seq += n; // skip the rest of the batch
                                match e {
                                    Error::Closed { .. } => break 'outer,
                                    Error::Timeout { .. } | Error::WouldBlock { .. } => {}
                                    Error::Unsupported { .. } if flaky => {}
                                    e => {
                                        log.lock().unwrap().errors.push(format!("produce: {e}"));
                                        break 'outer;
                                    }
                                }
                            }
                        }
                    }
                }
            }
            if left.fetch_sub(1, Ordering::SeqCst) == 1 {
                ring.close();
            }
            drop(ring);
            let _ = done.send("producer");
        });
    }

    for cid in 0..consumers {
        let ring = ring.clone();
        let log = Arc::clone(&log);
        let done = done_tx.clone();
        let bad = Arc::clone(&bad);
        let mut r = Rng::new(seed ^ (cid as u64 + 7).wrapping_mul(0x9876_5432_1fed));
        let stream = if r.below(3) == 0 { shared_stream.clone() } else { Stream::new(Device::Host).unwrap() };
        all_streams.lock().unwrap().push(stream.clone());
        let all_streams = Arc::clone(&all_streams);
        std::thread::spawn(move || {
            let mut kept = Vec::new();
            loop {
                pause(&mut r);
                let got = match r.below(3) {
                    0 => {
                        kept.clear();
                        ring.next(&stream)
                    }
                    1 => ring.next_timeout(&stream, Duration::from_micros(r.below(3000) as u64)),
                    _ => ring.try_next(&stream),
                };
                match got {
                    Ok(s) => {
                        let key = s.meta().sequence;
                        let (pid, seq) = (key >> 32, key & 0xffff_ffff);
                        let want = payload(pid, seq, slot);
                        let got = s.host_bytes().map(|b| b.to_vec());
                        match got {
                            Ok(b) if b == want => {}
                            Ok(b) => {
                                bad.store(true, Ordering::SeqCst);
                                log.lock().unwrap().errors.push(format!(
                                    "TORN c{cid} p{pid} s{seq}: len {} vs {}",
                                    b.len(),
                                    want.len()
                                ));
                            }
                            Err(e) => log.lock().unwrap().errors.push(format!("host_bytes: {e}")),
                        }
                        log.lock().unwrap().received.push((cid, pid, seq));
                        // Queue a delayed check on the consumer stream: the slot must not be
                        // overwritten until this ran (the consumed point is after it).
                        if r.below(2) == 0 {
                            let ptr = s.buffer().unwrap().as_ptr() as usize;
                            let delay = r.below(300) as u64;
                            let log2 = Arc::clone(&log);
                            let bad2 = Arc::clone(&bad);
                            stream
                                .host_fn(move || {
                                    std::thread::sleep(Duration::from_micros(delay));
                                    // SAFETY: the slot's memory belongs to the ring, which
                                    // `stats_ring` keeps alive until every stream used here
                                    // has been synchronized; the read is of `want.len()` bytes
                                    // the slot holds. A write racing it is the bug it detects.
                                    let now =
                                        unsafe { std::slice::from_raw_parts(ptr as *const u8, want.len()) };
                                    if now != &want[..] {
                                        bad2.store(true, Ordering::SeqCst);
                                        log2.lock()
                                            .unwrap()
                                            .errors
                                            .push(format!("OVERWRITTEN before release c{cid} p{pid} s{seq}"));
                                    }
                                })
                                .unwrap();
                        }
                        match r.below(5) {
                            0 => {
                                let _ = s.release();
                            }
                            4 => {
                                // dropped inside a job of its own stream (or another)
                                let target = if r.below(2) == 0 {
                                    stream.clone()
                                } else {
                                    Stream::new(Device::Host).unwrap()
                                };
                                all_streams.lock().unwrap().push(target.clone());
                                target.host_fn(move || drop(s)).unwrap();
                            }
                            1 if kept.len() < 2 => kept.push(s),
                            _ => drop(s),
                        }
                        if r.below(3) == 0 && !kept.is_empty() {
                            kept.remove(0);
                        }
                    }
                    Err(Error::Closed { .. }) => break,
                    Err(Error::Timeout { .. }) | Err(Error::WouldBlock { .. }) => {
                        // Keep held slots from starving producers forever.
                        kept.clear();
                    }
                    Err(Error::Unsupported { .. }) if flaky => kept.clear(),
                    Err(e) => {
                        log.lock().unwrap().errors.push(format!("next: {e}"));
                        kept.clear();
                    }
                }
            }
            if r.below(2) == 0 {
                drop(ring);
                drop(kept);
            } else {
                drop(kept);
                drop(ring);
            }
            drop(stream);
            let _ = done.send("consumer");
        });
    }
    drop(done_tx);
    if close_early {
        let us = rng.below(3000) as u64;
        std::thread::sleep(Duration::from_micros(us));
        ring.close();
    }
    let stats_ring = ring.clone();
    if rng.below(2) == 0 {
        drop(ring);
    }
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut finished = 0;
    while finished < producers + consumers {
        let left = deadline.saturating_duration_since(Instant::now());
        match done_rx.recv_timeout(left) {
            Ok(_) => finished += 1,
            Err(_) => {
                let l = log.lock().unwrap();
                return Err(format!(
                    "HANG seed {seed}: {finished}/{} threads done; depth {depth} slot {slot} P{producers} C{consumers} items {items} close_early {close_early}; pub {} recv {}; stats {:?}",
                    producers + consumers,
                    l.published.len(),
                    l.received.len(),
                    stats_ring.stats()
                ));
            }
        }
    }
    for st in all_streams.lock().unwrap().iter() {
        st.synchronize().map_err(|e| format!("sync: {e}"))?;
    }
    let l = log.lock().unwrap();
    let mut errs: Vec<String> =
        l.errors.iter().filter(|e| !e.starts_with("UNKNOWN-PREFIX")).cloned().collect();
    if bad.load(Ordering::SeqCst) {
        errs.push("bad flag".into());
    }
    let unknown = false;
    let in_uncertain =
        |k: &(u64, u64)| l.uncertain.iter().any(|&(p, lo, hi)| p == k.0 && k.1 >= lo && k.1 < hi);
    let mut count: HashMap<(u64, u64), usize> = HashMap::new();
    for &(_, p, s) in &l.received {
        *count.entry((p, s)).or_default() += 1;
    }
    for (&k, &c) in &count {
        if c != 1 {
            errs.push(format!("item {k:?} received {c} times"));
        }
    }
    if !unknown {
        for k in &l.published {
            if !count.contains_key(k) {
                errs.push(format!("published {k:?} never received"));
            }
        }
        let pubset: std::collections::HashSet<_> = l.published.iter().collect();
        for k in count.keys() {
            if !pubset.contains(k) && !in_uncertain(k) {
                errs.push(format!("received {k:?} that was not reported published"));
            }
        }
    }
    // per consumer per producer in order
    let mut last: BTreeMap<(usize, u64), u64> = BTreeMap::new();
    for &(c, p, s) in &l.received {
        if let Some(&prev) = last.get(&(c, p)) {
            if s <= prev && !flaky {
                errs.push(format!("consumer {c} got p{p} s{s} after s{prev}"));
            }
        }
        last.insert((c, p), s);
    }
    for &(p, lo, hi) in &l.uncertain {
        let got: Vec<u64> = (lo..hi).filter(|s| count.contains_key(&(p, *s))).collect();
        if got != (lo..lo + got.len() as u64).collect::<Vec<_>>() {
            errs.push(format!("produce() published a non-prefix {got:?} of p{p} {lo}..{hi}"));
        }
    }
    let uncertain_pub: u64 = l
        .uncertain
        .iter()
        .map(|&(p, lo, hi)| (lo..hi).filter(|s| count.contains_key(&(p, *s))).count() as u64)
        .sum();
    let st = stats_ring.stats();
    if st.occupancy != 0 {
        errs.push(format!("occupancy {} at end", st.occupancy));
    }
    if !unknown && st.published != l.published.len() as u64 + uncertain_pub {
        errs.push(format!("stats.published {} vs {}", st.published, l.published.len()));
    }
    if std::env::var("CUFERRY_STRESS_VERBOSE").is_ok() {
        println!("seed {seed} depth {depth} slot {slot} P{producers} C{consumers} items {items} close_early {close_early}: pub {} recv {} errs {:?}", l.published.len(), l.received.len(), l.errors);
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(format!(
            "seed {seed} depth {depth} slot {slot} P{producers} C{consumers} items {items} close_early {close_early}: {:?}",
            errs
        ))
    }
}

#[test]
fn ring_stress() {
    stress::run_seeds(DEFAULT_ITERS, run_one);
}
