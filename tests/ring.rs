//! The slot ring with real threads: FIFO order, every byte checked (sequence ids and
//! checksums), depths 1, 2 and 8, fast and slow producers and consumers, several producers, no
//! slot in flight twice, close with slots in flight, errors mid-stream. Each protocol runs on
//! the host backend and, when a GPU is present, on CUDA.

mod common;
#[path = "ring_common/mod.rs"]
mod ring_common;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use cuferry::ring::{
    build_transfer_backend, ConsumerSlot, DType, PackExecutor, RingOptions, SlotLayout, SlotMeta, SlotRing,
    StreamTransferBackend, TransferBackend, MAX_PACK_THREADS, MAX_RING_DEPTH,
};
use cuferry::{copy_range, Device, DeviceBuffer, Error, HostRegistration, PinnedBuffer, Stream};
use ring_common::FlakyBackend;

const SLOT: usize = 64 << 10;

/// The payload of item `seq` from `producer`: length and bytes derived from both, with an
/// FNV-1a checksum in the first 8 bytes.
fn payload(producer: u64, seq: u64) -> Vec<u8> {
    let len = 16 + ((seq * 7919 + producer * 104_729) % (SLOT as u64 - 16)) as usize;
    let mut rng = common::Rng::new(seq ^ (producer << 32));
    let mut data = rng.bytes(len);
    let sum = fnv(&data[8..]);
    data[..8].copy_from_slice(&sum.to_le_bytes());
    data
}

fn fnv(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

/// Reads the published bytes of a slot on the host, whatever the backend.
fn read_slot(slot: &ConsumerSlot, stream: &Stream) -> Vec<u8> {
    let bytes = slot.meta().bytes;
    let buffer = slot.buffer().unwrap();
    if buffer.device().is_host() {
        return slot.host_bytes().unwrap().to_vec();
    }
    let mut out = PinnedBuffer::<u8>::zeroed(buffer.device(), bytes).unwrap();
    copy_range(stream, buffer, 0, &mut out, 0, bytes).unwrap();
    out.as_slice().unwrap().to_vec()
}

/// Checks one received slot against the payload its sequence id names.
fn check_slot(slot: &ConsumerSlot, stream: &Stream, producer: u64) {
    let got = read_slot(slot, stream);
    let want = payload(producer, slot.meta().sequence);
    assert_eq!(got.len(), want.len(), "length of item {}", slot.meta().sequence);
    let sum = u64::from_le_bytes(got[..8].try_into().unwrap());
    assert_eq!(sum, fnv(&got[8..]), "torn slot: checksum of item {}", slot.meta().sequence);
    assert!(got == want, "bytes of item {} differ", slot.meta().sequence);
}

fn publish(ring: &SlotRing, producer: u64, seq: u64) {
    let data = payload(producer, seq);
    let mut slot = ring.acquire().unwrap();
    slot.bytes_mut()[..data.len()].copy_from_slice(&data);
    // The producer id rides in the high bits of the sequence.
    slot.publish(SlotMeta::new(seq, SlotLayout::bytes(data.len()))).unwrap();
}

/// One producer, one consumer, items in order with every byte checked, for depth `depth`;
/// `producer_delay` / `consumer_delay` make one side the slow one.
fn stream_items(
    device: Device,
    depth: usize,
    items: u64,
    producer_delay: Duration,
    consumer_delay: Duration,
) {
    let ring = SlotRing::new(device, RingOptions::new(depth, SLOT)).unwrap();
    let producer = {
        let ring = ring.clone();
        std::thread::spawn(move || {
            for seq in 0..items {
                publish(&ring, 0, seq);
                std::thread::sleep(producer_delay);
            }
        })
    };
    let stream = Stream::new(device).unwrap();
    let slow_consumer = consumer_delay > producer_delay && items > depth as u64;
    if slow_consumer {
        // Before consuming anything the producer must fill the ring and then block on it.
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !(ring.stats().occupancy == depth && ring.stats().producer_waits > 0) {
            assert!(std::time::Instant::now() < deadline, "the ring never filled: {:?}", ring.stats());
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    for expected in 0..items {
        let slot = ring.next(&stream).unwrap();
        assert_eq!(slot.meta().sequence, expected, "FIFO order");
        check_slot(&slot, &stream, 0);
        std::thread::sleep(consumer_delay);
        let stats = ring.stats();
        assert!(stats.occupancy <= depth && stats.high_water <= depth, "{stats:?}");
    }
    producer.join().unwrap();
    let stats = ring.stats();
    assert_eq!(stats.published, items);
    assert_eq!(stats.occupancy, 0, "slots leaked: {stats:?}");
    if slow_consumer {
        assert!(stats.producer_waits > 0 && stats.high_water == depth, "{stats:?}");
    }
}

fn depths_and_speeds(device: Device) {
    for depth in [1, 2, 8] {
        stream_items(device, depth, 40, Duration::ZERO, Duration::ZERO);
        stream_items(device, depth, 20, Duration::ZERO, Duration::from_millis(2)); // fast producer
        stream_items(device, depth, 20, Duration::from_millis(2), Duration::ZERO);
        // fast consumer
    }
}

/// Four producers at once; each one's items arrive in its order, all exactly once.
fn several_producers(device: Device) {
    let ring = SlotRing::new(device, RingOptions::new(3, SLOT)).unwrap();
    let per = 25u64;
    let handles: Vec<_> = (0..4u64)
        .map(|p| {
            let ring = ring.clone();
            std::thread::spawn(move || {
                for i in 0..per {
                    let seq = (p << 32) | i;
                    let data = payload(p, seq);
                    let mut slot = ring.acquire().unwrap();
                    slot.bytes_mut()[..data.len()].copy_from_slice(&data);
                    slot.publish(SlotMeta::new(seq, SlotLayout::bytes(data.len()))).unwrap();
                }
            })
        })
        .collect();
    let stream = Stream::new(device).unwrap();
    let mut next = [0u64; 4];
    for _ in 0..4 * per {
        let slot = ring.next(&stream).unwrap();
        let (p, i) = (slot.meta().sequence >> 32, slot.meta().sequence & 0xffff_ffff);
        assert_eq!(i, next[p as usize], "producer {p} out of order");
        next[p as usize] += 1;
        check_slot(&slot, &stream, p);
    }
    for h in handles {
        h.join().unwrap();
    }
    assert_eq!(next, [per; 4]);
    assert!(matches!(ring.try_next(&stream), Err(Error::WouldBlock { .. })));
}

/// No slot is handed out twice while in use: held consumer slots have distinct memory, and the
/// ring refuses more than `depth` at once.
fn no_slot_in_flight_twice(device: Device) {
    let depth = 4;
    let ring = SlotRing::new(device, RingOptions::new(depth, SLOT)).unwrap();
    let stream = Stream::new(device).unwrap();
    for round in 0..3u64 {
        for i in 0..depth as u64 {
            publish(&ring, 0, round * 10 + i);
        }
        assert!(matches!(ring.try_acquire(), Err(Error::WouldBlock { .. })));
        assert!(matches!(ring.acquire_timeout(Duration::from_millis(20)), Err(Error::Timeout { .. })));
        let held: Vec<ConsumerSlot> = (0..depth).map(|_| ring.next(&stream).unwrap()).collect();
        let ptrs: HashSet<usize> = held.iter().map(|s| s.buffer().unwrap().as_ptr() as usize).collect();
        assert_eq!(ptrs.len(), depth, "a device slot was handed out twice");
        for s in &held {
            check_slot(s, &stream, 0);
        }
        assert_eq!(ring.stats().occupancy, depth);
        drop(held);
        assert_eq!(ring.stats().occupancy, 0);
    }
    // Producers holding slots at once get distinct host memory.
    let mut a = ring.acquire().unwrap();
    let mut b = ring.acquire().unwrap();
    assert_ne!(a.bytes_mut().as_ptr(), b.bytes_mut().as_ptr());
}

/// Closing with slots in flight: consumers drain what was published, then get Closed;
/// producers get Closed; held slots stay valid after the ring handle is gone.
fn close_with_slots_in_flight(device: Device) {
    let ring = SlotRing::new(device, RingOptions::new(4, SLOT)).unwrap();
    let stream = Stream::new(device).unwrap();
    for seq in 0..3 {
        publish(&ring, 0, seq);
    }
    let held = ring.next(&stream).unwrap();
    let pending = ring.acquire().unwrap();
    ring.close();
    assert!(ring.is_closed());
    assert!(matches!(ring.try_acquire(), Err(Error::Closed { reason: None })));
    assert!(matches!(pending.publish(SlotMeta::new(99, SlotLayout::bytes(1))), Err(Error::Closed { .. })));
    for seq in 1..3 {
        let slot = ring.next(&stream).unwrap();
        assert_eq!(slot.meta().sequence, seq);
        check_slot(&slot, &stream, 0);
    }
    assert!(matches!(ring.next(&stream), Err(Error::Closed { reason: None })));
    drop(ring);
    check_slot(&held, &stream, 0);
    drop(held);
}

/// Errors mid-stream: abandoned fills are never handed out; a failed ring reports its error
/// after the complete slots are drained.
fn errors_mid_stream(device: Device) {
    let ring = SlotRing::new(device, RingOptions::new(2, SLOT)).unwrap();
    let stream = Stream::new(device).unwrap();
    let producer = {
        let ring = ring.clone();
        std::thread::spawn(move || {
            for seq in 0..30u64 {
                let data = payload(0, seq);
                let mut slot = ring.acquire().unwrap();
                // Half-filled, then the "fill" fails: the guard is dropped unpublished.
                let half = data.len() / 2;
                slot.bytes_mut()[..half].copy_from_slice(&data[..half]);
                if seq % 5 == 4 {
                    continue;
                }
                slot.bytes_mut()[half..data.len()].copy_from_slice(&data[half..]);
                slot.publish(SlotMeta::new(seq, SlotLayout::bytes(data.len()))).unwrap();
            }
            ring.fail(Error::InvalidArgument { what: "producer gave up".into() });
        })
    };
    let mut seen = Vec::new();
    loop {
        match ring.next(&stream) {
            Ok(slot) => {
                check_slot(&slot, &stream, 0);
                seen.push(slot.meta().sequence);
            }
            Err(Error::Closed { reason: Some(reason) }) => {
                assert!(reason.to_string().contains("producer gave up"));
                break;
            }
            Err(e) => panic!("unexpected {e:?}"),
        }
    }
    producer.join().unwrap();
    let want: Vec<u64> = (0..30).filter(|s| s % 5 != 4).collect();
    assert_eq!(seen, want);
}

/// Metadata that does not fit is refused and the ring stays usable; typed arrays round-trip.
fn layouts_and_bad_metadata(device: Device) {
    let ring = SlotRing::new(device, RingOptions::new(2, SLOT)).unwrap();
    let stream = Stream::new(device).unwrap();
    let slot = ring.acquire().unwrap();
    assert!(matches!(
        slot.publish(SlotMeta { sequence: 1, bytes: SLOT + 1, layout: SlotLayout::bytes(4) }),
        Err(Error::InvalidArgument { .. })
    ));
    assert_eq!(ring.stats().occupancy, 0, "a refused publish kept its slots");
    // A layout longer than the bytes uploaded (a consumer's array view would read bytes that
    // were never written).
    let slot = ring.acquire().unwrap();
    assert!(matches!(
        slot.publish(SlotMeta { sequence: 1, bytes: 4, layout: SlotLayout::bytes(8) }),
        Err(Error::InvalidArgument { .. })
    ));
    assert_eq!(ring.stats().occupancy, 0, "a refused publish kept its slots");
    // Layouts whose sizes overflow are refused when built.
    for huge in [
        SlotLayout::new().with::<f64>(&[usize::MAX, 2]),
        SlotLayout::new().with::<f64>(&[usize::MAX / 4]),
        SlotLayout::new().with::<u8>(&[usize::MAX]).and_then(|l| l.with::<u8>(&[1])),
    ] {
        assert!(matches!(huge, Err(Error::InvalidArgument { .. })), "{huge:?}");
    }
    let pool = PackExecutor::new(3).unwrap();
    let obs: Vec<f32> = (0..4 * 64).map(|i| i as f32 * 0.5).collect();
    let actions: Vec<i64> = vec![-3, 0, 7, 1 << 40];
    let layout = SlotLayout::new().with::<f32>(&[4, 64]).unwrap().with::<i64>(&[4]).unwrap();
    let mut slot = ring.acquire().unwrap();
    assert!(slot.write_array(&pool, &layout.arrays()[0], &actions).is_err());
    slot.write_array(&pool, &layout.arrays()[0], &obs).unwrap();
    slot.write_array(&pool, &layout.arrays()[1], &actions).unwrap();
    slot.publish(SlotMeta::new(5, layout.clone())).unwrap();
    let got = ring.next(&stream).unwrap();
    assert_eq!(got.meta().layout.arrays()[1].dtype, DType::I64);
    assert!(got.array_ptr::<f64>(0).is_err());
    assert_eq!(got.array_ptr::<f32>(0).unwrap().1, obs.len());
    let bytes = read_slot(&got, &stream);
    let a0 = &layout.arrays()[0];
    let a1 = &layout.arrays()[1];
    assert_eq!(bytemuck::cast_slice::<u8, f32>(&bytes[a0.offset..a0.offset + a0.bytes()]), &obs[..]);
    let mut back = vec![0i64; 4];
    bytemuck::cast_slice_mut::<i64, u8>(&mut back).copy_from_slice(&bytes[a1.offset..a1.offset + a1.bytes()]);
    assert_eq!(back, actions);
    if device.is_host() {
        assert_eq!(got.host_array::<f32>(0).unwrap(), &obs[..]);
    }
}

/// Caller memory registered as host slots, and upload timing.
fn registered_slots_and_timing(device: Device) {
    let mut backend = StreamTransferBackend::new(device, true).unwrap();
    // Whether the driver registers host memory at all (cudaDevAttrHostRegisterSupported).
    let registers = HostRegistration::new(device, vec![0u8; 1 << 20]).unwrap().is_pinned();
    // Twice: the second set replaces the first, and may lie on pages the first held.
    for _ in 0..2 {
        // Heap neighbours (64 KiB blocks side by side) share pages: every slot is
        // page-locked on CUDA whether the driver refuses a second registration on a page or
        // not (then the backend registers them as one range). One pageable slot would make
        // every upload synchronous.
        backend.register_host_slots(vec![vec![0u8; SLOT]; 3]).unwrap();
        let caps = backend.capabilities();
        assert_eq!(caps.host_pinned, registers, "{caps:?}");
        assert_eq!(caps.supports_async_submit, device.is_host() || registers, "{caps:?}");
    }
    if !device.is_host() && !registers {
        eprintln!("cuda: the driver registers no host memory; registered slots are pageable");
    }
    backend.allocate_device_slots(2, SLOT).unwrap();
    assert!(backend.capabilities().supports_timing_events);
    let ring = SlotRing::with_backend(Box::new(backend)).unwrap();
    let stream = Stream::new(device).unwrap();
    for seq in 0..10 {
        publish(&ring, 0, seq);
        let slot = ring.next(&stream).unwrap();
        check_slot(&slot, &stream, 0);
        slot.buffer().unwrap().synchronize().unwrap();
        let timing = slot.timing().unwrap();
        assert!(timing.device_ms.is_some_and(|ms| ms >= 0.0), "{timing:?}");
    }
}

/// Work the consumer queued on its stream before releasing a slot keeps the slot from being
/// overwritten, even work the ring cannot see (a raw read, like a kernel's): the consumer
/// queues a slow read of the slot, releases at once, and the read still sees its item.
fn release_orders_next_upload(device: Device) {
    let ring = SlotRing::new(device, RingOptions::new(1, SLOT)).unwrap();
    let stream = Stream::new(device).unwrap();
    let reads = Arc::new(Mutex::new(Vec::new()));
    let mut tracked = Vec::new();
    for seq in 0..6 {
        publish(&ring, 0, seq);
        let slot = ring.next(&stream).unwrap();
        let bytes = slot.meta().bytes;
        stream.host_fn(|| std::thread::sleep(Duration::from_millis(10))).unwrap();
        if device.is_host() {
            // An untracked read through the raw pointer, like a kernel's.
            let addr = slot.buffer().unwrap().as_ptr() as usize;
            let reads = Arc::clone(&reads);
            stream
                .host_fn(move || {
                    // SAFETY: the slot is host memory of at least `bytes` bytes, kept alive by
                    // the ring, and not rewritten before this queued read (the property tested).
                    let got = unsafe { std::slice::from_raw_parts(addr as *const u8, bytes) }.to_vec();
                    reads.lock().unwrap().push((seq, got));
                })
                .unwrap();
        } else {
            let mut out = DeviceBuffer::<u8>::zeroed(&stream, bytes).unwrap();
            copy_range(&stream, slot.buffer().unwrap(), 0, &mut out, 0, bytes).unwrap();
            tracked.push((seq, out));
        }
        slot.release().unwrap();
    }
    stream.synchronize().unwrap();
    for (seq, out) in tracked {
        reads.lock().unwrap().push((seq, out.to_vec(&stream).unwrap()));
    }
    let reads = reads.lock().unwrap();
    assert_eq!(reads.len(), 6);
    for (seq, got) in reads.iter() {
        assert!(*got == payload(0, *seq), "slot {seq} overwritten before its consumer finished");
    }
}

/// An upload's device time is the copy's alone: the wait for the consumer's release comes
/// before the timing starts. The consumer of a depth-1 ring queues 200 ms of work before it
/// releases the slot; the next upload into that slot must not count it.
fn upload_timing_excludes_the_wait_for_the_consumer(device: Device) {
    let ring = SlotRing::new(device, RingOptions { timing: true, ..RingOptions::new(1, SLOT) }).unwrap();
    let stream = Stream::new(device).unwrap();
    publish(&ring, 0, 0);
    let slot = ring.next(&stream).unwrap();
    stream.host_fn(|| std::thread::sleep(Duration::from_millis(200))).unwrap();
    slot.release().unwrap();
    publish(&ring, 0, 1);
    let slot = ring.next(&stream).unwrap();
    check_slot(&slot, &stream, 0);
    slot.buffer().unwrap().synchronize().unwrap();
    let ms = slot.timing().unwrap().device_ms.expect("the upload finished and is timed");
    assert!(ms < 150.0, "the upload's device time ({ms} ms) includes the consumer's 200 ms");
}

/// `try_acquire` and `acquire_timeout` stay bounded when the free host slot's last upload is
/// still queued behind work on the consumer's stream (the upload waits for the release of its
/// device slot, recorded after that work): the slot goes back to the ring, and is handed out,
/// intact, once the work has run.
fn bounded_acquires_never_wait_for_the_consumers_queue(device: Device) {
    let (ring, consumer, gate) = ring_waiting_for_an_upload(device);
    match ring.try_acquire() {
        Err(Error::WouldBlock { .. }) => {}
        other => panic!("try_acquire: expected WouldBlock, got {other:?}"),
    }
    assert!(!gate.passed(), "try_acquire waited for the consumer's queue");
    match ring.acquire_timeout(Duration::from_millis(50)) {
        Err(Error::Timeout { waited, .. }) => assert!(waited >= Duration::from_millis(50), "{waited:?}"),
        other => panic!("acquire_timeout: expected Timeout, got {other:?}"),
    }
    assert!(!gate.passed(), "acquire_timeout waited for the consumer's queue");
    gate.open();
    publish(&ring, 0, 2);
    check_slot(&ring.next(&consumer).unwrap(), &consumer, 0);
    consumer.synchronize().unwrap();
    assert_eq!(ring.stats().occupancy, 0, "{:?}", ring.stats());
}

/// A depth-1 ring whose free host slot's last upload waits for a release held back behind
/// the returned gate on the returned consumer stream (its device slot is free).
fn ring_waiting_for_an_upload(device: Device) -> (Arc<SlotRing>, Stream, common::Gate) {
    let ring = Arc::new(SlotRing::new(device, RingOptions::new(1, SLOT)).unwrap());
    let consumer = Stream::new(device).unwrap();
    publish(&ring, 0, 0);
    let first = ring.next(&consumer).unwrap();
    let gate = common::Gate::hold(&consumer);
    drop(first); // released behind the gate
    publish(&ring, 0, 1); // its upload waits for that release
    drop(ring.next(&consumer).unwrap()); // the device slot is free again; the host slot is not
    (ring, consumer, gate)
}

/// A close reaches a producer waiting for its host slot's last upload (queued behind a release
/// held back on the consumer's stream): one polling with a timeout gets `Error::Closed` at
/// once, one blocked in `acquire` gets it once the upload has finished. Neither is handed a
/// slot of the closed ring.
fn close_reaches_producers_waiting_for_an_upload(device: Device) {
    let (ring, consumer, gate) = ring_waiting_for_an_upload(device);
    let polling = Arc::clone(&ring);
    let polling = std::thread::spawn(move || polling.acquire_timeout(Duration::from_secs(60)).map(drop));
    // Once it holds the slots, it polls the upload.
    assert!(common::wait_until(|| ring.stats().occupancy == 1), "the producer did not take the slot");
    ring.close();
    let closed_at = std::time::Instant::now();
    let polled = polling.join().unwrap();
    assert!(matches!(polled, Err(Error::Closed { .. })), "acquire_timeout after close: {polled:?}");
    assert!(closed_at.elapsed() < Duration::from_secs(5), "acquire_timeout ran on after the close");
    assert!(!gate.passed(), "the polling producer returned only once the upload finished");
    gate.open();
    consumer.synchronize().unwrap();
    assert_eq!(ring.stats().occupancy, 0, "{:?}", ring.stats());

    let (ring, consumer, gate) = ring_waiting_for_an_upload(device);
    let blocked = Arc::clone(&ring);
    let blocked = std::thread::spawn(move || blocked.acquire().map(drop));
    // Once it holds the slots, it waits for the upload.
    assert!(common::wait_until(|| ring.stats().occupancy == 1), "the producer did not take the slot");
    ring.close();
    gate.open();
    let blocked = blocked.join().unwrap();
    assert!(matches!(blocked, Err(Error::Closed { .. })), "acquire after close: {blocked:?}");
    consumer.synchronize().unwrap();
    assert_eq!(ring.stats().occupancy, 0, "{:?}", ring.stats());
}

on_both_backends! {
    bounded_acquires_never_wait_for_the_consumers_queue => bounded_acquires_never_wait_for_the_consumers_queue;
    close_reaches_producers_waiting_for_an_upload => close_reaches_producers_waiting_for_an_upload;
    failed_submissions => failed_submissions;
    depths_and_speeds => depths_and_speeds;
    several_producers => several_producers;
    no_slot_in_flight_twice => no_slot_in_flight_twice;
    close_with_slots_in_flight => close_with_slots_in_flight;
    errors_mid_stream => errors_mid_stream;
    layouts_and_bad_metadata => layouts_and_bad_metadata;
    registered_slots_and_timing => registered_slots_and_timing;
    release_orders_next_upload => release_orders_next_upload;
    upload_timing_excludes_the_wait_for_the_consumer => upload_timing_excludes_the_wait_for_the_consumer;
    publish_racing_close_never_strands_a_slot => publish_racing_close_never_strands_a_slot;
    a_panicking_backend_never_loses_a_slot => a_panicking_backend_never_loses_a_slot;
    huge_timeouts_wait_forever => huge_timeouts_wait_forever;
    one_blocked_acquire_counts_one_wait => one_blocked_acquire_counts_one_wait;
    a_failed_ordering_keeps_the_slot_first => a_failed_ordering_keeps_the_slot_first;
    a_handed_back_slot_wakes_a_waiting_consumer => a_handed_back_slot_wakes_a_waiting_consumer;
    a_closed_ring_is_drained_only_when_no_slot_can_come_back => a_closed_ring_is_drained_only_when_no_slot_can_come_back;
}

/// A depth-1 ring over `FlakyBackend` (no failed submissions) as `configure` sets it up.
fn flaky_ring(device: Device, configure: impl FnOnce(FlakyBackend) -> FlakyBackend) -> SlotRing {
    flaky_ring_with(device, 1, configure).unwrap()
}

/// A ring of `depth` slots over `FlakyBackend` (no failed submissions) as `configure` sets it
/// up, or the ring's refusal.
fn flaky_ring_with(
    device: Device,
    depth: usize,
    configure: impl FnOnce(FlakyBackend) -> FlakyBackend,
) -> cuferry::Result<SlotRing> {
    let mut inner = StreamTransferBackend::new(device, false).unwrap();
    inner.allocate_host_slots(depth, SLOT).unwrap();
    inner.allocate_device_slots(depth, SLOT).unwrap();
    SlotRing::with_backend(Box::new(configure(FlakyBackend::new(inner, usize::MAX))))
}

/// A custom backend panicking in `next` (ordering the consumer's stream) or in `release`
/// (recording the consumed point) still gives the device slot back: a depth-1 ring would
/// otherwise block forever.
fn a_panicking_backend_never_loses_a_slot(device: Device) {
    let stream = Stream::new(device).unwrap();
    let in_next = flaky_ring(device, FlakyBackend::panic_once_in_wait);
    publish(&in_next, 0, 0);
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| in_next.next(&stream)));
    assert!(unwound.is_err(), "the injected panic did not happen");
    assert_eq!(in_next.stats().occupancy, 0, "{:?}", in_next.stats());
    publish(&in_next, 0, 1);
    check_slot(&in_next.next_timeout(&stream, Duration::from_secs(5)).unwrap(), &stream, 0);

    let in_release = flaky_ring(device, FlakyBackend::panic_once_in_release);
    publish(&in_release, 0, 0);
    let slot = in_release.next(&stream).unwrap();
    let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| slot.release()));
    assert!(unwound.is_err(), "the injected panic did not happen");
    assert_eq!(in_release.stats().occupancy, 0, "{:?}", in_release.stats());
    publish(&in_release, 0, 1);
    check_slot(&in_release.next_timeout(&stream, Duration::from_secs(5)).unwrap(), &stream, 0);
}

/// A consumer whose stream cannot be ordered after the upload gets the error, and the slot
/// stays first in the FIFO: the next calls (each way of taking) receive every item in publish
/// order, nothing dropped, and the ring keeps its depth.
fn a_failed_ordering_keeps_the_slot_first(device: Device) {
    let stream = Stream::new(device).unwrap();
    let ring = flaky_ring_with(device, 4, |b| b.failing_waits(3)).unwrap();
    for seq in 0..4 {
        publish(&ring, 0, seq);
    }
    let injected = |r: cuferry::Result<ConsumerSlot>| match r {
        Err(Error::Unsupported { what }) => assert!(what.contains("injected wait failure"), "{what}"),
        other => panic!("expected the injected failure, got {other:?}"),
    };
    injected(ring.try_next(&stream));
    injected(ring.next_timeout(&stream, Duration::from_secs(5)));
    injected(ring.next(&stream));
    assert_eq!(ring.stats().occupancy, 4, "{:?}", ring.stats());
    for seq in 0..4 {
        let slot = ring.next_timeout(&stream, Duration::from_secs(5)).unwrap();
        assert_eq!(slot.meta().sequence, seq);
        check_slot(&slot, &stream, 0);
    }
    assert!(matches!(ring.try_next(&stream), Err(Error::WouldBlock { .. })));
    // Every slot went back: the ring takes a full depth again.
    for seq in 4..8 {
        publish(&ring, 0, seq);
    }
    ring.close();
    let rest: Vec<u64> = std::iter::from_fn(|| ring.next(&stream).ok().map(|s| s.meta().sequence)).collect();
    assert_eq!(rest, [4, 5, 6, 7]);
}

/// Two consumers wait on one published slot; whichever receives it first fails to order its
/// stream and returns, and the slot it hands back wakes the other, which receives it intact.
fn a_handed_back_slot_wakes_a_waiting_consumer(device: Device) {
    let ring = Arc::new(flaky_ring(device, |b| b.failing_waits(1)));
    let (started_tx, started_rx) = std::sync::mpsc::channel();
    let consumers: Vec<_> = (0..2)
        .map(|_| {
            let (ring, started) = (Arc::clone(&ring), started_tx.clone());
            std::thread::spawn(move || {
                let stream = Stream::new(device).unwrap();
                started.send(()).unwrap();
                let got = ring.next_timeout(&stream, Duration::from_secs(10));
                got.map(|slot| {
                    check_slot(&slot, &stream, 0);
                    slot.meta().sequence
                })
            })
        })
        .collect();
    for _ in 0..2 {
        started_rx.recv().unwrap();
    }
    // Both are (almost surely) asleep by now; either order of arrival must work.
    std::thread::sleep(Duration::from_millis(50));
    publish(&ring, 0, 7);
    let results: Vec<_> = consumers.into_iter().map(|c| c.join().unwrap()).collect();
    let received: Vec<u64> = results.iter().filter_map(|r| r.as_ref().ok().copied()).collect();
    assert_eq!(received, [7], "{results:?}");
    let failed = results.iter().filter(|r| matches!(r, Err(Error::Unsupported { .. }))).count();
    assert_eq!(failed, 1, "{results:?}");
}

/// A closed ring whose last slot is in a consumer's hands, while that consumer fails to order
/// its stream, is not drained yet: other consumers wait for the slot to come back (or are told
/// to try again) instead of being told `Closed` while it is still to be handed out.
fn a_closed_ring_is_drained_only_when_no_slot_can_come_back(device: Device) {
    let (entered_tx, entered) = std::sync::mpsc::channel();
    let (release, release_rx) = std::sync::mpsc::channel();
    let ring = Arc::new(flaky_ring(device, |b| b.held_failing_wait(entered_tx, release_rx)));
    publish(&ring, 0, 42);
    ring.close();
    let first = {
        let ring = Arc::clone(&ring);
        std::thread::spawn(move || ring.next(&Stream::new(device).unwrap()).map(|s| s.meta().sequence))
    };
    entered.recv_timeout(Duration::from_secs(10)).unwrap();
    let stream = Stream::new(device).unwrap();
    assert!(matches!(ring.try_next(&stream), Err(Error::WouldBlock { .. })));
    assert!(matches!(ring.next_timeout(&stream, Duration::from_millis(20)), Err(Error::Timeout { .. })));
    let second = {
        let ring = Arc::clone(&ring);
        std::thread::spawn(move || {
            let stream = Stream::new(device).unwrap();
            let slot = ring.next_timeout(&stream, Duration::from_secs(10))?;
            check_slot(&slot, &stream, 0);
            Ok::<_, Error>(slot.meta().sequence)
        })
    };
    std::thread::sleep(Duration::from_millis(20));
    release.send(()).unwrap();
    assert!(matches!(first.join().unwrap(), Err(Error::Unsupported { .. })));
    assert_eq!(second.join().unwrap().unwrap(), 42);
    assert!(matches!(ring.next(&stream), Err(Error::Closed { reason: None })));
    assert_eq!(ring.stats().occupancy, 0, "{:?}", ring.stats());
}

/// `Duration::MAX` (a common way to say "forever") neither panics computing a deadline nor
/// keeps a ready slot from being returned.
fn huge_timeouts_wait_forever(device: Device) {
    let ring = SlotRing::new(device, RingOptions::new(1, SLOT)).unwrap();
    let stream = Stream::new(device).unwrap();
    let slot = ring.acquire_timeout(Duration::MAX).unwrap();
    let data = payload(0, 0);
    let mut slot = slot;
    slot.bytes_mut()[..data.len()].copy_from_slice(&data);
    slot.publish(SlotMeta::new(0, SlotLayout::bytes(data.len()))).unwrap();
    check_slot(&ring.next_timeout(&stream, Duration::MAX).unwrap(), &stream, 0);
    // A zero timeout on a full ring gives up at once (no polling past the deadline).
    let _held = ring.acquire().unwrap();
    match ring.acquire_timeout(Duration::ZERO) {
        Err(Error::Timeout { waited, .. }) => assert!(waited < Duration::from_secs(1), "{waited:?}"),
        other => panic!("expected a timeout, got {other:?}"),
    }
    match ring.next_timeout(&stream, Duration::ZERO) {
        Err(Error::Timeout { .. }) => {}
        other => panic!("expected a timeout, got {other:?}"),
    }
}

/// One acquire that finds the ring full counts one producer wait, however it retries: the
/// pipelined fill's tries while it publishes, then its blocking acquire.
fn one_blocked_acquire_counts_one_wait(device: Device) {
    let ring = SlotRing::new(device, RingOptions::new(2, SLOT)).unwrap();
    let pool = PackExecutor::new(2).unwrap();
    let data = vec![7u8; 1000];
    std::thread::scope(|scope| {
        scope.spawn(|| {
            // Items 0 and 1 fill the ring; item 2 waits for this consumer, once.
            assert!(common::wait_until(|| ring.stats().producer_waits == 1), "{:?}", ring.stats());
            let stream = Stream::new(device).unwrap();
            for _ in 0..3 {
                drop(ring.next(&stream).unwrap());
            }
        });
        let items = (0..3).map(|i| cuferry::ring::SlotFill::bytes(i, &data));
        assert_eq!(ring.produce(&pool, 2, items).unwrap(), 3);
    });
    assert_eq!(ring.stats().producer_waits, 1, "{:?}", ring.stats());
    // Plain acquires: a miss on a full ring counts once, whether it blocks, times out or
    // would block.
    let held = (ring.acquire().unwrap(), ring.acquire().unwrap());
    assert!(matches!(ring.try_acquire(), Err(Error::WouldBlock { .. })));
    assert!(matches!(ring.acquire_timeout(Duration::from_millis(1)), Err(Error::Timeout { .. })));
    assert_eq!(ring.stats().producer_waits, 3, "{:?}", ring.stats());
    drop(held);
}

/// A release that fails (here: a custom backend's panic) from a job of the consumer's own
/// host stream gives the slot back behind the consumer's queued work instead of waiting on the
/// host for that stream, which is waiting for the job itself: the ring's fallback hung the
/// stream's worker for good (a review's reproduction). Then the ring goes on.
#[test]
fn a_failed_release_in_a_job_of_the_consumer_stream_returns_the_slot_in_order() {
    let ring = flaky_ring(Device::Host, FlakyBackend::panic_once_in_release);
    let consumer = Stream::new(Device::Host).unwrap();
    publish(&ring, 0, 0);
    let (report, unwound) = std::sync::mpsc::channel();
    let (own, in_job) = (consumer.clone(), ring.clone());
    consumer
        .host_fn(move || {
            let slot = in_job.next(&own).unwrap();
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| slot.release()));
            let _ = report.send(result.is_err());
        })
        .unwrap();
    let Ok(unwound) = unwound.recv_timeout(Duration::from_secs(10)) else {
        std::mem::forget((consumer, ring));
        panic!("a release failing in a job of the consumer stream never returned");
    };
    assert!(unwound, "the injected panic did not happen");
    consumer.synchronize().unwrap();
    assert_eq!(ring.stats().occupancy, 0, "{:?}", ring.stats());
    publish(&ring, 0, 1);
    check_slot(&ring.next_timeout(&consumer, Duration::from_secs(5)).unwrap(), &consumer, 0);
}

/// `host_bytes` never hands out more bytes than the slot's memory holds, even when a custom
/// backend (safe code) overstates its slot size and so lets a longer publish through.
#[test]
fn host_bytes_is_bounded_by_the_slot_memory() {
    let ring = flaky_ring(Device::Host, |b| b.overstating_slot_bytes(1 << 30));
    let stream = Stream::new(Device::Host).unwrap();
    ring.acquire().unwrap().publish(SlotMeta::new(0, SlotLayout::bytes(64 << 20))).unwrap();
    let slot = ring.next(&stream).unwrap();
    assert_eq!(slot.buffer().unwrap().len(), SLOT);
    match slot.host_bytes() {
        Err(Error::InvalidArgument { what }) => assert!(what.contains("exceeds"), "{what}"),
        other => panic!("expected an error, got {:?}", other.map(<[u8]>::len)),
    }
}

/// Empty arrays read as empty on the host backend, also in a slot whose upload is empty (its
/// bytes have no address to cast); a hand-made array layout whose shape overflows matches no
/// data instead of panicking.
#[test]
fn empty_and_overflowing_arrays() {
    let ring = SlotRing::new(Device::Host, RingOptions::new(2, SLOT)).unwrap();
    let stream = Stream::new(Device::Host).unwrap();
    let layout = SlotLayout::new().with::<f32>(&[0]).unwrap().with::<f64>(&[3, 0]).unwrap();
    ring.acquire().unwrap().publish(SlotMeta::new(0, layout)).unwrap();
    let slot = ring.next(&stream).unwrap();
    assert_eq!(slot.host_array::<f32>(0).unwrap(), &[] as &[f32]);
    assert_eq!(slot.host_array::<f64>(1).unwrap(), &[] as &[f64]);
    drop(slot);
    let huge = cuferry::ring::ArrayLayout { offset: 0, dtype: DType::F32, shape: vec![1 << 33, 1 << 33] };
    assert_eq!((huge.len(), huge.bytes()), (usize::MAX, usize::MAX));
    let pool = PackExecutor::new(1).unwrap();
    let mut producer = ring.acquire().unwrap();
    assert!(matches!(producer.write_array(&pool, &huge, &[1.0f32]), Err(Error::InvalidArgument { .. })));
}

/// A publish racing a close either fails with `Closed` or reaches the consumer, who drains it
/// before seeing `Closed`: no slot is stranded published but never handed out (found by a
/// memcheck run, where the pipelined fill's close test left one slot occupied).
fn publish_racing_close_never_strands_a_slot(device: Device) {
    for round in 0..200u64 {
        let ring = SlotRing::new(device, RingOptions::new(2, 64)).unwrap();
        let stream = Stream::new(device).unwrap();
        let (published, consumed) = std::thread::scope(|s| {
            let producer = s.spawn(|| {
                let mut published = 0u64;
                while let Ok(slot) = ring.acquire() {
                    match slot.publish(SlotMeta::new(published, SlotLayout::bytes(8))) {
                        Ok(()) => published += 1,
                        Err(Error::Closed { .. }) => break,
                        Err(e) => panic!("unexpected {e:?}"),
                    }
                }
                published
            });
            s.spawn(|| {
                // Close at a different point of the stream each round.
                let spins = (round * 7919) % 20_000;
                for _ in 0..spins {
                    std::hint::spin_loop();
                }
                ring.close();
            });
            let mut consumed = 0u64;
            loop {
                match ring.next_timeout(&stream, Duration::from_secs(30)) {
                    Ok(slot) => {
                        assert_eq!(slot.meta().sequence, consumed, "round {round}: out of order");
                        consumed += 1;
                    }
                    Err(Error::Closed { .. }) => break,
                    Err(e) => panic!("round {round}: unexpected {e:?}"),
                }
            }
            (producer.join().unwrap(), consumed)
        });
        assert_eq!(published, consumed, "round {round}: a published slot never reached the consumer");
        assert_eq!(ring.stats().occupancy, 0, "round {round}: a slot stayed occupied");
    }
}

/// A failed submission returns the error to its producer; the ring stays usable and never
/// hands out the slot.
fn failed_submissions(device: Device) {
    let mut inner = StreamTransferBackend::new(device, false).unwrap();
    inner.allocate_host_slots(2, SLOT).unwrap();
    inner.allocate_device_slots(2, SLOT).unwrap();
    let ring = SlotRing::with_backend(Box::new(FlakyBackend::new(inner, 4))).unwrap();
    let stream = Stream::new(device).unwrap();
    let delivered = Arc::new(Mutex::new(Vec::new()));
    for seq in 0..20u64 {
        let data = payload(0, seq);
        let mut slot = ring.acquire().unwrap();
        slot.bytes_mut()[..data.len()].copy_from_slice(&data);
        match slot.publish(SlotMeta::new(seq, SlotLayout::bytes(data.len()))) {
            Ok(()) => {
                let got = ring.next(&stream).unwrap();
                check_slot(&got, &stream, 0);
                delivered.lock().unwrap().push(got.meta().sequence);
            }
            Err(Error::Unsupported { what }) => assert!(what.contains("injected")),
            Err(e) => panic!("unexpected {e:?}"),
        }
        assert!(
            matches!(ring.try_next(&stream), Err(Error::WouldBlock { .. })),
            "a failed slot was handed out"
        );
    }
    let want: Vec<u64> = (0..20).filter(|s| s % 4 != 3).collect();
    assert_eq!(*delivered.lock().unwrap(), want);
    assert_eq!(ring.stats().occupancy, 0);
}

#[test]
fn pack_executor_copies_every_byte() {
    let mut rng = common::Rng::new(3);
    for threads in [1, 2, 5] {
        let pool = PackExecutor::new(threads).unwrap();
        for len in [0, 1, 1000, 256 << 10, (256 << 10) + 1, 3 << 20, (5 << 20) + 77] {
            let src = rng.bytes(len);
            let mut dst = vec![0u8; len];
            pool.copy(&src, &mut dst).unwrap();
            assert!(src == dst, "threads {threads}, len {len}");
        }
    }
    assert!(PackExecutor::new(0).is_err());
    let pool = PackExecutor::new(2).unwrap();
    assert!(pool.copy(&[1, 2], &mut [0; 3]).is_err());
}

#[test]
fn spinning_pack_executor_copies_every_byte_and_stops() {
    let mut rng = common::Rng::new(4);
    for (threads, spin_us) in [(2, 50), (5, 200), (3, 1)] {
        let pool = PackExecutor::with_spin(threads, Duration::from_micros(spin_us)).unwrap();
        assert_eq!(pool.spin(), Duration::from_micros(spin_us));
        // Back to back (workers still polling) and after a pause (workers asleep).
        for (round, len) in [3 << 20, (1 << 20) + 5, 3 << 20, 77, (5 << 20) + 1].into_iter().enumerate() {
            if round == 3 {
                std::thread::sleep(Duration::from_millis(2));
            }
            let src = rng.bytes(len);
            let mut dst = vec![0u8; len];
            pool.copy(&src, &mut dst).unwrap();
            assert!(src == dst, "threads {threads}, spin {spin_us} us, len {len}");
        }
        // Dropping joins the workers, whether they poll or sleep (a worker that kept
        // polling would hang the test here).
        drop(pool);
    }
    // Closing stops the polling at once: a drop does not wait out a long spin.
    let pool = PackExecutor::with_spin(2, Duration::from_secs(30)).unwrap();
    pool.copy(&rng.bytes(1 << 20), &mut vec![0u8; 1 << 20]).unwrap();
    let started = std::time::Instant::now();
    drop(pool);
    assert!(started.elapsed() < Duration::from_secs(10), "drop took {:?}", started.elapsed());
    assert!(PackExecutor::with_spin(0, Duration::from_micros(10)).is_err());
    assert_eq!(PackExecutor::new(2).unwrap().spin(), Duration::ZERO);
}

#[test]
fn bad_ring_options() {
    assert!(SlotRing::new(Device::Host, RingOptions::new(0, 16)).is_err());
    assert!(SlotRing::new(Device::Host, RingOptions::new(2, 0)).is_err());
    let empty = StreamTransferBackend::new(Device::Host, false).unwrap();
    assert!(SlotRing::with_backend(Box::new(empty)).is_err());
    // Garbage sizes are refused before anything is allocated, not by exhausting memory.
    for (depth, slot_bytes) in [(MAX_RING_DEPTH + 1, 16), (usize::MAX, 1), (1 << 40, 1 << 30)] {
        let err = SlotRing::new(Device::Host, RingOptions::new(depth, slot_bytes)).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{depth} x {slot_bytes}: {err:?}");
    }
    // The options are checked before the device is touched: a depth over the cap on a device
    // that does not exist is still an argument error, as the C ABI documents, not NoDevice.
    let absent = Device::Cuda(4095);
    for timing in [false, true] {
        let options = RingOptions { timing, ..RingOptions::new(MAX_RING_DEPTH + 1, 16) };
        let err = SlotRing::new(absent, options).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
    }
    let built = build_transfer_backend(absent, MAX_RING_DEPTH + 1);
    assert!(matches!(built, Err(Error::InvalidArgument { .. })), "{:?}", built.err());
    let (depth, slot_bytes) = (MAX_RING_DEPTH, usize::MAX / 2);
    let err = SlotRing::new(Device::Host, RingOptions::new(depth, slot_bytes)).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument { .. }), "overflowing total: {err:?}");
    let mut backend = StreamTransferBackend::new(Device::Host, false).unwrap();
    assert!(matches!(backend.allocate_host_slots(usize::MAX, 1), Err(Error::InvalidArgument { .. })));
    assert!(matches!(backend.allocate_device_slots(usize::MAX, 1), Err(Error::InvalidArgument { .. })));
    let too_many = vec![Vec::new(); MAX_RING_DEPTH + 1];
    assert!(matches!(backend.register_host_slots(too_many), Err(Error::InvalidArgument { .. })));
    // A custom backend claiming more slots than a ring has is refused, not queued slot by slot.
    for count in [MAX_RING_DEPTH + 1, usize::MAX] {
        let ring = flaky_ring_with(Device::Host, 1, |b| b.overstating_slot_counts(count));
        assert!(matches!(ring, Err(Error::InvalidArgument { .. })), "{count} slots");
    }
    for threads in [MAX_PACK_THREADS + 1, usize::MAX] {
        assert!(
            matches!(PackExecutor::new(threads), Err(Error::InvalidArgument { .. })),
            "{threads} threads"
        );
    }
}

/// Stats read while producers take and give back slots never show an occupancy above the
/// high-water mark (the two are separate counters, raised one after the other).
#[test]
fn stats_never_show_occupancy_above_the_high_water_mark() {
    let ring = SlotRing::new(Device::Host, RingOptions::new(8, 64)).unwrap();
    let stop = std::sync::atomic::AtomicBool::new(false);
    std::thread::scope(|scope| {
        for _ in 0..2 {
            scope.spawn(|| {
                while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                    drop(ring.acquire().unwrap()); // unpublished: both slots go back
                }
            });
        }
        for read in 0..200_000 {
            let s = ring.stats();
            if s.occupancy > s.high_water {
                stop.store(true, std::sync::atomic::Ordering::Relaxed);
                panic!("read {read}: occupancy {} above the high-water mark {}", s.occupancy, s.high_water);
            }
        }
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
    });
}

/// A publish of 0 bytes queues no copy, yet its slot is still ordered after the previous
/// consumer: the first consumer queues a slow read of the device slot and releases at once; a
/// 0-byte item is published into the same slot; the second consumer's write to it (like a
/// kernel working in place) must run after the first consumer's read.
#[test]
fn an_empty_publish_still_waits_for_the_previous_consumer() {
    let ring = SlotRing::new(Device::Host, RingOptions::new(1, SLOT)).unwrap();
    let (first, second) = (Stream::new(Device::Host).unwrap(), Stream::new(Device::Host).unwrap());
    publish(&ring, 0, 0);
    let slot = ring.next(&first).unwrap();
    let bytes = slot.meta().bytes;
    let addr = slot.buffer().unwrap().as_ptr() as usize;
    let read = Arc::new(Mutex::new(Vec::new()));
    {
        let read = Arc::clone(&read);
        first
            .host_fn(move || {
                std::thread::sleep(Duration::from_millis(100));
                // SAFETY: the ring keeps the host-backend slot alive, and the slot is not
                // rewritten before this queued read (the property tested).
                *read.lock().unwrap() =
                    unsafe { std::slice::from_raw_parts(addr as *const u8, bytes) }.to_vec();
            })
            .unwrap();
    }
    slot.release().unwrap();
    ring.acquire().unwrap().publish(SlotMeta::new(1, SlotLayout::bytes(0))).unwrap();
    let slot = ring.next(&second).unwrap();
    assert_eq!(slot.meta().bytes, 0);
    let addr = slot.buffer().unwrap().as_ptr() as usize;
    second
        .host_fn(move || {
            // SAFETY: as above; the write is ordered after the first consumer's read.
            unsafe { std::ptr::write_bytes(addr as *mut u8, 0xEE, bytes) };
        })
        .unwrap();
    slot.release().unwrap();
    second.synchronize().unwrap();
    first.synchronize().unwrap();
    assert!(*read.lock().unwrap() == payload(0, 0), "the second consumer wrote under the first one's read");
}

/// The counters include an item by the time a consumer holds it: a consumer reading the stats
/// after each `next` never sees fewer slots or bytes published than it received.
#[test]
fn counters_include_every_received_item() {
    let ring = Arc::new(SlotRing::new(Device::Host, RingOptions::new(8, 64)).unwrap());
    let items = 20_000u64;
    let producer = {
        let ring = Arc::clone(&ring);
        std::thread::spawn(move || {
            for seq in 0..items {
                let slot = ring.acquire().unwrap();
                slot.publish(SlotMeta::new(seq, SlotLayout::bytes(1 + (seq % 64) as usize))).unwrap();
            }
        })
    };
    let stream = Stream::new(Device::Host).unwrap();
    let (mut received, mut bytes) = (0u64, 0u64);
    let mut lagging = 0u64;
    while received < items {
        let slot = ring.next(&stream).unwrap();
        received += 1;
        bytes += slot.meta().bytes as u64;
        let stats = ring.stats();
        if stats.published < received || stats.bytes < bytes {
            lagging += 1;
        }
        drop(slot);
    }
    producer.join().unwrap();
    assert_eq!(lagging, 0, "{lagging} of {items} received items were not yet counted as published");
    assert_eq!((ring.stats().published, ring.stats().bytes), (received, bytes));
}
