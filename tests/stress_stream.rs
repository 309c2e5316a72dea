//! Randomized stress of host streams and events: DAGs of host_fn jobs with event edges,
//! queued from 1-3 threads on 1-4 streams with 1-4 events: records (re-recorded while
//! pending), waits, synchronizes and queries from any thread, streams and events dropped and
//! replaced while work is pending, jobs that hold and drop stream handles, and panicking jobs.
//!
//! Rules (checked against a shared model): every job runs exactly once, after every job that
//! program order and event edges put before it; a successful synchronize or a true query
//! covers what it should; a panic is reported only on its own stream, only to a synchronize
//! called after it was queued, and at least once per stream that had one. A run that does not
//! finish in 20 s is a hang, reported with its seed. `CUFERRY_STRESS_ITERS` and
//! `CUFERRY_STRESS_SEED` pick the seeds; `CUFERRY_STRESS_NO_PANICS` turns panics off.
mod common;

use std::collections::BTreeSet;
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::stress::{self, pause};
use common::Rng;
use cuferry::{Device, Error, Event, Stream};

/// Seeds run by the test suite (a few seconds); `CUFERRY_STRESS_ITERS` runs more.
const DEFAULT_ITERS: u64 = 150;

/// Job states: 0 queued, 1 running, 2 done; runs counts executions.
struct JobState {
    state: Vec<u8>,
    runs: Vec<u32>,
    errors: Vec<String>,
    /// stream id of each job, whether it panics, times its panic was reported
    stream_of: Vec<u64>,
    panics: Vec<bool>,
    reported: Vec<u32>,
}

/// Checks an error returned by synchronize/query of stream `sid`; `upto`: jobs ids below it
/// were submitted before the call (None: any).
fn check_report(
    js: &Mutex<JobState>,
    res: Result<bool, Error>,
    sid: u64,
    upto: Option<usize>,
    what: &str,
) -> bool {
    match res {
        Ok(b) => b,
        Err(Error::HostFnPanicked { message }) => {
            let mut g = js.lock().unwrap();
            let id: usize = message.trim_start_matches("stress-panic ").parse().unwrap();
            g.reported[id] += 1;
            if g.reported[id] > 1 {
                g.errors.push(format!("{what}: panic of job {id} reported twice"));
            }
            if g.stream_of[id] != sid {
                let other = g.stream_of[id];
                g.errors.push(format!("{what}: panic of job {id} (stream {other}) reported on stream {sid}"));
            }
            if let Some(u) = upto {
                if id >= u {
                    g.errors.push(format!("{what}: panic of job {id} submitted after the call (upto {u})"));
                }
            }
            false
        }
        Err(e) => {
            js.lock().unwrap().errors.push(format!("{what}: unexpected {e}"));
            false
        }
    }
}

struct Model {
    streams: Vec<Option<Stream>>,
    /// last job queued on each stream slot's current stream
    last: Vec<Option<usize>>,
    /// deps from waits queued since the last job
    wait_deps: Vec<BTreeSet<usize>>,
    events: Vec<Arc<Mutex<Option<Event>>>>,
    /// what the latest record of each event covers
    cover: Vec<Option<BTreeSet<usize>>>,
    next_job: usize,
    /// dropped streams, kept for the final error check when PANICS
    retired: Vec<Stream>,
}

/// Stream `s` of the model, made again first if it was dropped.
fn live_stream(streams: &mut [Option<Stream>], s: usize) -> &Stream {
    streams[s].get_or_insert_with(|| Stream::new(Device::Host).unwrap())
}

fn covered(m: &Model, s: usize) -> BTreeSet<usize> {
    let mut c = m.wait_deps[s].clone();
    if let Some(j) = m.last[s] {
        c.insert(j);
    }
    c
}

fn check_done(js: &Mutex<JobState>, deps: &BTreeSet<usize>, what: &str) {
    let mut g = js.lock().unwrap();
    let missing: Vec<usize> = deps.iter().copied().filter(|&d| g.state[d] != 2).collect();
    if !missing.is_empty() {
        g.errors.push(format!("{what}: jobs {missing:?} not done"));
    }
}

fn run_one(seed: u64) -> Result<(), String> {
    let mut rng = Rng::new(seed);
    let nstreams = 1 + rng.below(4);
    let nevents = 1 + rng.below(4);
    let threads = 1 + rng.below(3);
    let ops = 5 + rng.below(60);
    let max_jobs = threads * ops + 16;
    let js = Arc::new(Mutex::new(JobState {
        state: vec![0; max_jobs],
        runs: vec![0; max_jobs],
        errors: vec![],
        stream_of: vec![0; max_jobs],
        panics: vec![false; max_jobs],
        reported: vec![0; max_jobs],
    }));
    let model = Arc::new(Mutex::new(Model {
        streams: (0..nstreams).map(|_| Some(Stream::new(Device::Host).unwrap())).collect(),
        last: vec![None; nstreams],
        wait_deps: vec![BTreeSet::new(); nstreams],
        events: (0..nevents).map(|_| Arc::new(Mutex::new(Some(Event::new(Device::Host).unwrap())))).collect(),
        cover: vec![None; nevents],
        next_job: 0,
        retired: vec![],
    }));
    let (done_tx, done_rx) = mpsc::channel::<()>();
    for t in 0..threads {
        let js = Arc::clone(&js);
        let model = Arc::clone(&model);
        let done = done_tx.clone();
        let mut r = Rng::new(seed ^ ((t as u64 + 3) * 0x1f1f_2e2e_3d3d));
        std::thread::spawn(move || {
            for _ in 0..ops {
                pause(&mut r);
                let s = r.below(nstreams);
                match r.below(10) {
                    // queue a job
                    0..=3 => {
                        let mut m = model.lock().unwrap();
                        live_stream(&mut m.streams, s);
                        let id = m.next_job;
                        m.next_job += 1;
                        let deps = covered(&m, s);
                        let delay = r.below(201) as u64;
                        let js2 = Arc::clone(&js);
                        // Sometimes a job holds (and drops when it runs) a handle of some stream.
                        let held = if r.below(5) == 0 { m.streams[r.below(nstreams)].clone() } else { None };
                        let panics = stress::mode("CUFERRY_STRESS_NO_PANICS") && r.below(6) == 0;
                        {
                            let mut g = js.lock().unwrap();
                            g.stream_of[id] = m.streams[s].as_ref().unwrap().id();
                            g.panics[id] = panics;
                        }
                        m.streams[s]
                            .as_ref()
                            .unwrap()
                            .host_fn(move || {
                                {
                                    let mut g = js2.lock().unwrap();
                                    let missing: Vec<usize> =
                                        deps.iter().copied().filter(|&d| g.state[d] != 2).collect();
                                    if !missing.is_empty() {
                                        g.errors.push(format!("job {id} started before {missing:?}"));
                                    }
                                    g.state[id] = 1;
                                    g.runs[id] += 1;
                                }
                                if delay > 20 {
                                    std::thread::sleep(Duration::from_micros(delay));
                                }
                                drop(held);
                                js2.lock().unwrap().state[id] = 2;
                                if panics {
                                    std::panic::panic_any(format!("stress-panic {id}"));
                                }
                            })
                            .unwrap();
                        m.last[s] = Some(id);
                        m.wait_deps[s].clear();
                    }
                    // record event
                    4 | 5 => {
                        let e = r.below(nevents);
                        let ev_lock = Arc::clone(&model.lock().unwrap().events[e]);
                        let ev = ev_lock.lock().unwrap();
                        let mut m = model.lock().unwrap();
                        if let Some(ev) = ev.as_ref() {
                            ev.record(live_stream(&mut m.streams, s)).unwrap();
                            let c = covered(&m, s);
                            m.cover[e] = Some(c);
                        }
                    }
                    // wait event
                    6 | 7 => {
                        let e = r.below(nevents);
                        let ev_lock = Arc::clone(&model.lock().unwrap().events[e]);
                        let ev = ev_lock.lock().unwrap();
                        let mut m = model.lock().unwrap();
                        if let Some(ev) = ev.as_ref() {
                            live_stream(&mut m.streams, s).wait_event(ev).unwrap();
                            if let Some(c) = m.cover[e].clone() {
                                m.wait_deps[s].extend(c);
                            }
                        }
                    }
                    // synchronize a stream (outside the model lock)
                    8 => {
                        let locked = r.below(2) == 0;
                        let mut guard = Some(model.lock().unwrap());
                        let (st, deps, upto) = {
                            let m = guard.as_ref().unwrap();
                            (m.streams[s].clone(), covered(m, s), m.next_job)
                        };
                        if !locked {
                            guard = None;
                        }
                        if let Some(st) = st {
                            let sid = st.id();
                            if r.below(2) == 0 {
                                let res = st.synchronize().map(|()| true);
                                // Unlocked: jobs may be submitted before the call starts.
                                let upto = if locked { upto } else { model.lock().unwrap().next_job };
                                check_report(&js, res, sid, Some(upto), "stream.synchronize");
                                check_done(&js, &deps, "stream.synchronize");
                            } else if check_report(&js, st.query(), sid, None, "stream.query") {
                                check_done(&js, &deps, "stream.query true");
                            }
                        }
                        drop(guard);
                    }
                    // event sync / drop stream / drop event
                    _ => match r.below(4) {
                        0 | 1 => {
                            let e = r.below(nevents);
                            let ev_lock = Arc::clone(&model.lock().unwrap().events[e]);
                            let ev = ev_lock.lock().unwrap();
                            let deps = model.lock().unwrap().cover[e].clone().unwrap_or_default();
                            if let Some(ev) = ev.as_ref() {
                                if r.below(2) == 0 {
                                    ev.synchronize().unwrap();
                                    check_done(&js, &deps, "event.synchronize");
                                } else if ev.query().unwrap() {
                                    check_done(&js, &deps, "event.query true");
                                }
                            }
                        }
                        2 => {
                            let mut m = model.lock().unwrap();
                            if let Some(st) = m.streams[s].clone() {
                                m.retired.push(st);
                            }
                            let old = m.streams[s].take();
                            m.last[s] = None;
                            m.wait_deps[s].clear();
                            drop(m);
                            drop(old);
                        }
                        _ => {
                            let e = r.below(nevents);
                            let ev_lock = Arc::clone(&model.lock().unwrap().events[e]);
                            let mut ev = ev_lock.lock().unwrap();
                            let mut m = model.lock().unwrap();
                            *ev = Some(Event::new(Device::Host).unwrap());
                            m.cover[e] = None;
                        }
                    },
                }
            }
            let _ = done.send(());
        });
    }
    drop(done_tx);
    let deadline = Instant::now() + Duration::from_secs(20);
    for i in 0..threads {
        if done_rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).is_err() {
            return Err(format!("HANG seed {seed}: {i}/{threads} submitters done"));
        }
    }
    // Wait for every job (some streams were dropped).
    let total = model.lock().unwrap().next_job;
    let mut finals: Vec<Stream> = Vec::new();
    if stress::mode("CUFERRY_STRESS_NO_PANICS") {
        let mut m = model.lock().unwrap();
        finals.extend(m.streams.iter().flatten().cloned());
        finals.append(&mut m.retired);
    }
    drop(model);
    for st in &finals {
        let sid = st.id();
        let res = st.synchronize().map(|()| true);
        check_report(&js, res, sid, None, "final synchronize");
        let res = st.synchronize().map(|()| true);
        if !check_report(&js, res, sid, None, "second final synchronize") {
            js.lock().unwrap().errors.push(format!("stream {sid}: an error after a reporting synchronize"));
        }
    }
    loop {
        {
            let g = js.lock().unwrap();
            if g.state[..total].iter().all(|&s| s == 2) {
                break;
            }
            if Instant::now() > deadline {
                let pending: Vec<usize> = (0..total).filter(|&i| g.state[i] != 2).collect();
                return Err(format!("HANG seed {seed}: jobs {pending:?} never finished"));
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    std::thread::sleep(Duration::from_millis(1));
    let g = js.lock().unwrap();
    let mut errs = g.errors.clone();
    if stress::mode("CUFERRY_STRESS_NO_PANICS") {
        let mut sids: Vec<u64> = (0..total).filter(|&i| g.panics[i]).map(|i| g.stream_of[i]).collect();
        sids.dedup();
        for sid in sids {
            let any = (0..total).any(|i| g.stream_of[i] == sid && g.reported[i] > 0);
            if !any {
                errs.push(format!("stream {sid} had panicking jobs but none was reported"));
            }
        }
        for i in 0..total {
            if g.reported[i] > 0 && !g.panics[i] {
                errs.push(format!("job {i} reported but did not panic"));
            }
        }
    }
    for i in 0..total {
        if g.runs[i] != 1 {
            errs.push(format!("job {i} ran {} times", g.runs[i]));
        }
    }
    if errs.is_empty() {
        Ok(())
    } else {
        Err(format!("seed {seed} S{nstreams} E{nevents} T{threads} ops {ops}: {errs:?}"))
    }
}

#[test]
fn stream_stress() {
    let default = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        let quiet = info.payload().downcast_ref::<String>().is_some_and(|m| m.starts_with("stress-panic"));
        if !quiet {
            default(info);
        }
    }));
    stress::run_seeds(DEFAULT_ITERS, run_one);
}
