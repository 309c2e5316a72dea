//! `SlotRing::produce`, the pipelined fill from pageable memory, with real threads: items
//! arrive in order with every piece's bytes checked against its source, for depths 1-8, fill
//! windows 1..=depth and 1-4 executor threads; a consumer that only queues work on its items
//! (so host slots come back with their uploads pending) gets every byte; a consumer holding
//! every slot at once does not deadlock it, nor do two producers sharing a ring and an
//! executor; bad items, a close, a failed submission and a panicking iterator each end it with
//! a published prefix and no slot lost; `produce_timeout` gives up on a stalled consumer (a
//! full ring, a busy host slot) with the count of its own published prefix, counting only
//! the time it waited on the consumers. Each runs on the
//! host backend and, when a GPU is present, on CUDA.

mod common;
#[path = "ring_common/mod.rs"]
mod ring_common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use cuferry::ring::{
    ConsumerSlot, PackExecutor, RingOptions, SlotFill, SlotLayout, SlotMeta, SlotRing, StreamTransferBackend,
    TransferBackend,
};
use cuferry::{copy_range, Device, DeviceBuffer, Error, PinnedBuffer, Stream};
use proptest::prelude::*;
use ring_common::FlakyBackend;

/// Slots of 256 KiB: pieces of up to 96 KiB split into several 64 KiB chunks.
const SLOT: usize = 256 << 10;
/// How long a consumer waits for an item before the test fails instead of hanging.
const PATIENCE: Duration = Duration::from_secs(20);

/// One item: the bytes uploaded and the pieces (offset, data) copied into the slot.
struct Item {
    seq: u64,
    bytes: usize,
    pieces: Vec<(usize, Vec<u8>)>,
}

/// Item `seq` for slots of `slot` bytes: 1-4 pieces of random lengths, in random order, with
/// random gaps between them, all inside its uploaded bytes.
fn item(seq: u64, slot: usize) -> Item {
    let mut rng = common::Rng::new(seq.wrapping_mul(31) ^ slot as u64);
    let count = 1 + rng.below(4);
    let room = slot / count;
    let mut pieces = Vec::with_capacity(count);
    for k in 0..count {
        let len = 1 + rng.below(room.min(96 << 10) - 1);
        let gap = rng.below(room - len);
        pieces.push((k * room + gap, rng.bytes(len)));
    }
    let end = pieces.iter().map(|(o, d)| o + d.len()).max().unwrap_or(0);
    let bytes = end + rng.below(slot - end + 1);
    // A random order of pieces: the fill must not depend on it.
    let turn = rng.below(count);
    pieces.rotate_left(turn);
    Item { seq, bytes, pieces }
}

fn items(count: u64, slot: usize) -> Vec<Item> {
    (0..count).map(|seq| item(seq, slot)).collect()
}

fn fill(item: &Item) -> SlotFill<'_> {
    let meta = SlotMeta { sequence: item.seq, bytes: item.bytes, layout: SlotLayout::bytes(item.bytes) };
    item.pieces.iter().fold(SlotFill::new(meta), |f, (offset, data)| f.piece(*offset, data))
}

/// Checks a received slot: its metadata and, byte for byte, every piece of the item it names.
fn check(slot: &ConsumerSlot, stream: &Stream, items: &[Item]) {
    let want = &items[slot.meta().sequence as usize];
    assert_eq!(slot.meta().bytes, want.bytes, "bytes of item {}", want.seq);
    let buffer = slot.buffer().unwrap();
    let got = if buffer.device().is_host() {
        slot.host_bytes().unwrap().to_vec()
    } else {
        let mut out = PinnedBuffer::<u8>::zeroed(buffer.device(), want.bytes).unwrap();
        copy_range(stream, buffer, 0, &mut out, 0, want.bytes).unwrap();
        out.as_slice().unwrap().to_vec()
    };
    for (offset, data) in &want.pieces {
        let range = *offset..offset + data.len();
        assert!(got[range.clone()] == data[..], "item {}: bytes {range:?} differ (torn slot?)", want.seq);
    }
}

/// Closes the ring when the consumer holding it panics, so the producer gets `Closed` instead
/// of waiting forever for slots and the test fails rather than hangs.
struct CloseOnPanic<'a>(&'a SlotRing);

impl Drop for CloseOnPanic<'_> {
    fn drop(&mut self) {
        if std::thread::panicking() {
            self.0.close();
        }
    }
}

/// Runs `f`, closing `ring` if it has not returned after [`PATIENCE`]: a call that should
/// have timed out then ends with [`Error::Closed`] (and its test fails) instead of hanging.
fn closing_after_patience<T>(ring: &SlotRing, f: impl FnOnce() -> T) -> T {
    let (done, finished) = std::sync::mpsc::channel::<()>();
    std::thread::scope(|s| {
        s.spawn(move || {
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = finished.recv_timeout(PATIENCE) {
                ring.close();
            }
        });
        let out = f();
        drop(done);
        out
    })
}

/// Consumes `count` items in order on `device`, checking each; the items received.
fn consume(ring: &SlotRing, device: Device, count: usize, items: &[Item]) -> Vec<u64> {
    let _guard = CloseOnPanic(ring);
    let stream = Stream::new(device).unwrap();
    let mut seen = Vec::with_capacity(count);
    for _ in 0..count {
        let slot = ring.next_timeout(&stream, PATIENCE).unwrap();
        assert_eq!(slot.meta().sequence, seen.len() as u64, "FIFO order");
        check(&slot, &stream, items);
        seen.push(slot.meta().sequence);
    }
    seen
}

/// Every item arrives once, in order, with its bytes, for depths, windows and thread counts;
/// the consumer is sometimes the slow side.
fn streams_every_byte_in_order(device: Device) {
    let data = items(24, SLOT);
    for (depth, ahead, threads, slow) in
        [(1, 1, 1, false), (2, 2, 3, true), (4, 3, 4, false), (8, 8, 2, true), (3, 0, 3, false)]
    {
        let ring = SlotRing::new(device, RingOptions::new(depth, SLOT)).unwrap();
        let pool = PackExecutor::new(threads).unwrap();
        let seen = std::thread::scope(|s| {
            let consumer = s.spawn(|| {
                let _guard = CloseOnPanic(&ring);
                let stream = Stream::new(device).unwrap();
                let mut seen = Vec::new();
                for expected in 0..data.len() as u64 {
                    let slot = ring.next_timeout(&stream, PATIENCE).unwrap();
                    assert_eq!(slot.meta().sequence, expected, "FIFO order");
                    check(&slot, &stream, &data);
                    seen.push(expected);
                    if slow {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
                seen
            });
            let published = ring.produce(&pool, ahead, data.iter().map(fill)).unwrap();
            assert_eq!(published, data.len() as u64, "depth {depth}, ahead {ahead}, {threads} threads");
            consumer.join().unwrap()
        });
        assert_eq!(seen.len(), data.len());
        let stats = ring.stats();
        assert_eq!((stats.published, stats.occupancy), (data.len() as u64, 0), "{stats:?}");
        assert!(stats.high_water <= depth, "{stats:?}");
    }
}

/// A consumer that holds every slot before releasing any: the producer must publish what it
/// has filled rather than block holding it.
fn consumer_holding_every_slot(device: Device) {
    let depth = 3;
    let data = items(15, SLOT);
    let ring = SlotRing::new(device, RingOptions::new(depth, SLOT)).unwrap();
    let pool = PackExecutor::new(2).unwrap();
    std::thread::scope(|s| {
        let producer = s.spawn(|| ring.produce(&pool, depth, data.iter().map(fill)));
        let _guard = CloseOnPanic(&ring);
        let stream = Stream::new(device).unwrap();
        for round in 0..data.len() / depth {
            let held: Vec<ConsumerSlot> =
                (0..depth).map(|_| ring.next_timeout(&stream, PATIENCE).expect("deadlocked")).collect();
            for (k, slot) in held.iter().enumerate() {
                assert_eq!(slot.meta().sequence, (round * depth + k) as u64);
                check(slot, &stream, &data);
            }
        }
        assert_eq!(producer.join().unwrap().unwrap(), data.len() as u64);
    });
}

/// An invalid item ends the call after the items before it are published; the ring stays
/// usable.
fn bad_items_end_with_a_published_prefix(device: Device) {
    let data = items(10, SLOT);
    let ring = SlotRing::new(device, RingOptions::new(8, SLOT)).unwrap();
    let pool = PackExecutor::new(3).unwrap();
    let past_end = vec![1u8; 16];
    let overlap = vec![2u8; 64];
    let bad: [(&str, SlotFill); 3] = [
        ("a piece past the uploaded bytes", SlotFill::bytes(6, &past_end).piece(8, &past_end)),
        (
            "overlapping pieces",
            SlotFill::new(SlotMeta::new(6, SlotLayout::bytes(256))).piece(0, &overlap).piece(32, &overlap),
        ),
        (
            "more bytes than a slot",
            SlotFill::new(SlotMeta { sequence: 6, bytes: SLOT + 1, layout: SlotLayout::new() }),
        ),
    ];
    for (what, bad) in bad {
        let fills = data[..6].iter().map(fill).chain([bad]).chain(data[7..].iter().map(fill));
        match ring.produce(&pool, 4, fills) {
            Err(Error::InvalidArgument { .. }) => {}
            other => panic!("{what}: {other:?}"),
        }
        assert_eq!(consume(&ring, device, 6, &data), (0..6).collect::<Vec<_>>(), "{what}");
        let stream = Stream::new(device).unwrap();
        assert!(
            matches!(ring.try_next(&stream), Err(Error::WouldBlock { .. })),
            "{what}: more than the prefix"
        );
        assert_eq!(ring.stats().occupancy, 0, "{what}: slots leaked");
    }
    // An empty piece overlaps nothing, even inside another piece or at its start.
    let full = vec![3u8; 100];
    let empty_inside = SlotFill::bytes(0, &full).piece(50, &[]).piece(0, &[]).piece(100, &[]);
    assert_eq!(ring.produce(&pool, 1, [empty_inside]).unwrap(), 1);
    let stream = Stream::new(device).unwrap();
    let got = ring.next(&stream).unwrap();
    assert_eq!(got.host_bytes().unwrap(), &full[..], "an empty piece changed the bytes");
    drop(got);
    // Typed pieces are checked against the layout.
    let layout = SlotLayout::new().with::<f32>(&[4]).unwrap();
    let meta = SlotMeta::new(0, layout);
    assert!(SlotFill::new(meta.clone()).array(0, &[1.0f32; 4]).is_ok());
    assert!(SlotFill::new(meta.clone()).array(0, &[1.0f32; 3]).is_err());
    assert!(SlotFill::new(meta.clone()).array(0, &[1.0f64; 4]).is_err());
    assert!(SlotFill::new(meta).array(1, &[1.0f32; 4]).is_err());
}

/// Closing the ring mid-stream: the call returns `Closed`; the consumer drains an in-order
/// prefix, every slot whole.
fn close_mid_stream(device: Device) {
    let data = items(40, SLOT);
    let ring = SlotRing::new(device, RingOptions::new(4, SLOT)).unwrap();
    let pool = PackExecutor::new(3).unwrap();
    let seen = std::thread::scope(|s| {
        let consumer = s.spawn(|| {
            let _guard = CloseOnPanic(&ring);
            let stream = Stream::new(device).unwrap();
            let mut seen = Vec::new();
            loop {
                match ring.next_timeout(&stream, PATIENCE) {
                    Ok(slot) => {
                        check(&slot, &stream, &data);
                        seen.push(slot.meta().sequence);
                        if seen.len() == 5 {
                            ring.close();
                        }
                    }
                    Err(Error::Closed { .. }) => return seen,
                    Err(e) => panic!("unexpected {e:?}"),
                }
            }
        });
        let produced = ring.produce(&pool, 3, data.iter().map(fill));
        assert!(matches!(produced, Err(Error::Closed { .. })), "{produced:?}");
        consumer.join().unwrap()
    });
    assert!(seen.len() >= 5 && seen.len() < data.len(), "{seen:?}");
    assert_eq!(seen, (0..seen.len() as u64).collect::<Vec<_>>(), "not an in-order prefix");
    assert_eq!(ring.stats().occupancy, 0);
}

/// A failed submission ends the call with its error; what was published is a prefix, the
/// failed slot and the later fills go back, and the ring takes the rest afterwards.
fn failed_submission(device: Device) {
    let data = items(12, SLOT);
    let mut inner = StreamTransferBackend::new(device, false).unwrap();
    inner.allocate_host_slots(4, SLOT).unwrap();
    inner.allocate_device_slots(4, SLOT).unwrap();
    let ring = SlotRing::with_backend(Box::new(FlakyBackend::new(inner, 4))).unwrap();
    let pool = PackExecutor::new(3).unwrap();
    match ring.produce(&pool, 3, data.iter().map(fill)) {
        Err(Error::Unsupported { what }) => assert!(what.contains("injected")),
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(ring.stats().published, 3);
    assert_eq!(consume(&ring, device, 3, &data), vec![0, 1, 2]);
    assert_eq!(ring.stats().occupancy, 0, "the failed or pending slots leaked");
    // Items 3.. again: the 8th submission (item 6) fails next.
    let rest = ring.produce(&pool, 3, data[3..].iter().map(fill));
    assert!(matches!(rest, Err(Error::Unsupported { .. })), "{rest:?}");
    let stream = Stream::new(device).unwrap();
    for seq in 3..6 {
        let slot = ring.next_timeout(&stream, PATIENCE).unwrap();
        assert_eq!(slot.meta().sequence, seq);
        check(&slot, &stream, &data);
    }
    assert!(matches!(ring.try_next(&stream), Err(Error::WouldBlock { .. })));
}

/// An iterator that panics mid-stream: the call unwinds only after its queued copies finish,
/// its unpublished slots go back, and the ring keeps working.
fn panicking_iterator(device: Device) {
    let data = items(8, SLOT);
    let ring = SlotRing::new(device, RingOptions::new(8, SLOT)).unwrap();
    let pool = PackExecutor::new(3).unwrap();
    let unwound = AtomicBool::new(false);
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        let fills = data.iter().enumerate().map(|(i, item)| {
            if i == 5 {
                unwound.store(true, Ordering::SeqCst);
                panic!("the batch loader failed");
            }
            fill(item)
        });
        ring.produce(&pool, 4, fills)
    }));
    assert!(result.is_err() && unwound.load(Ordering::SeqCst));
    let published = ring.stats().published as usize;
    assert!(published <= 5);
    assert_eq!(ring.stats().occupancy, published, "unpublished slots were not returned");
    assert_eq!(consume(&ring, device, published, &data).len(), published);
    // The ring and the executor still work.
    let again = items(3, SLOT);
    assert_eq!(ring.produce(&pool, 2, again.iter().map(fill)).unwrap(), 3);
    assert_eq!(consume(&ring, device, 3, &again), vec![0, 1, 2]);
}

/// Two producers share one ring and one executor (each waits on the other's chunks too):
/// each one's items arrive in its order, all of them, every piece intact.
fn two_producers_share_an_executor(device: Device) {
    let per = 12u64;
    let data = items(2 * per, SLOT);
    let ring = SlotRing::new(device, RingOptions::new(3, SLOT)).unwrap();
    let pool = PackExecutor::new(3).unwrap();
    std::thread::scope(|s| {
        // Producer p publishes items p, p + 2, p + 4, ... (their sequence ids index `data`).
        let producers: Vec<_> = (0..2)
            .map(|p| {
                let (ring, pool, data) = (&ring, &pool, &data);
                s.spawn(move || ring.produce(pool, 3, data.iter().skip(p).step_by(2).map(fill)))
            })
            .collect();
        let _guard = CloseOnPanic(&ring);
        let stream = Stream::new(device).unwrap();
        let mut next = [0u64, 1];
        for _ in 0..2 * per {
            let slot = ring.next_timeout(&stream, PATIENCE).expect("stalled");
            let seq = slot.meta().sequence;
            let p = (seq % 2) as usize;
            assert_eq!(seq, next[p], "producer {p} out of order");
            next[p] += 2;
            check(&slot, &stream, &data);
        }
        for producer in producers {
            assert_eq!(producer.join().unwrap().unwrap(), per);
        }
        assert_eq!(next, [2 * per, 2 * per + 1]);
    });
    assert_eq!(ring.stats().occupancy, 0);
}

/// A consumer that, like a kernel, only queues its work on each item (a copy, then 2 ms) and
/// releases it at once: the next upload into that device slot waits for the work, so the
/// producer finds host slots whose last upload is still pending (on CUDA, the common case) and
/// must publish its finished fills meanwhile, never refill a host slot before its upload has
/// run. The copies, read after the last item, hold every item's bytes.
fn uploads_waiting_for_a_busy_consumer(device: Device) {
    let (depth, count) = (3, 18);
    let data = items(count, SLOT);
    let ring = SlotRing::new(device, RingOptions::new(depth, SLOT)).unwrap();
    let pool = PackExecutor::new(2).unwrap();
    let stream = Stream::new(device).unwrap();
    let copies = std::thread::scope(|s| {
        let producer = s.spawn(|| ring.produce(&pool, depth, data.iter().map(fill)));
        let _guard = CloseOnPanic(&ring);
        let mut copies = Vec::new();
        for expected in 0..count {
            let slot = ring.next_timeout(&stream, PATIENCE).expect("deadlocked");
            assert_eq!(slot.meta().sequence, expected, "FIFO order");
            let bytes = slot.meta().bytes;
            let mut out = DeviceBuffer::<u8>::zeroed(&stream, bytes).unwrap();
            copy_range(&stream, slot.buffer().unwrap(), 0, &mut out, 0, bytes).unwrap();
            stream.host_fn(|| std::thread::sleep(Duration::from_millis(2))).unwrap();
            drop(slot); // released behind the copy and the work
            copies.push(out);
        }
        assert_eq!(producer.join().unwrap().unwrap(), count);
        copies
    });
    for (item, out) in data.iter().zip(&copies) {
        let got = out.to_vec(&stream).unwrap();
        for (offset, piece) in &item.pieces {
            let range = *offset..offset + piece.len();
            assert!(
                got[range.clone()] == piece[..],
                "item {}: bytes {range:?} differ (refilled early?)",
                item.seq
            );
        }
    }
    let stats = ring.stats();
    assert_eq!((stats.published, stats.occupancy), (count, 0), "{stats:?}");
}

/// An iterator that lags the consumer (it makes item k only once item k + 1 - ahead was
/// taken: lock step, as on-policy feedback does, for `ahead == 1`) gets its items published,
/// for every executor size (with no workers the producing thread copies) and `ahead` of 1 to
/// 3: while the iterator runs, at most `ahead - 1` earlier items are unpublished. One more
/// would leave both waiting for ever (the code before this rule held `ahead` for `ahead > 1`).
fn lagging_iterator_gets_its_items_published(device: Device) {
    let data = items(8, SLOT);
    for ahead in 1..=3u64 {
        for threads in [1, 2, 4] {
            let ring = SlotRing::new(device, RingOptions::new(4, SLOT)).unwrap();
            let pool = PackExecutor::new(threads).unwrap();
            let (taken, wait_taken) = std::sync::mpsc::channel::<u64>();
            std::thread::scope(|s| {
                let consumer = s.spawn(|| {
                    let _guard = CloseOnPanic(&ring);
                    let stream = Stream::new(device).unwrap();
                    for expected in 0..data.len() as u64 {
                        let slot =
                            ring.next_timeout(&stream, Duration::from_secs(5)).expect("item not published");
                        assert_eq!(slot.meta().sequence, expected);
                        check(&slot, &stream, &data);
                        drop(slot);
                        taken.send(expected).unwrap();
                    }
                });
                let lagging = data.iter().map(|item| {
                    if item.seq >= ahead {
                        // The consumer took item seq - ahead (or gave up: then stop here).
                        let previous = wait_taken.recv_timeout(Duration::from_secs(10));
                        assert_eq!(previous.ok(), Some(item.seq - ahead), "ahead {ahead}, {threads} threads");
                    }
                    fill(item)
                });
                let published = ring.produce(&pool, ahead as usize, lagging);
                consumer.join().unwrap();
                assert_eq!(published.unwrap(), data.len() as u64);
            });
        }
    }
}

/// `produce_timeout` on a ring another producer shares: with no consumer it publishes what
/// fits and times out, reporting its own count (not the ring's); a zero timeout fails at once;
/// after the consumer drains, a second call resumes from that count and every item arrives
/// once, in order, intact; a bad item later ends a call with the count of those before it.
fn produce_timeout_reports_its_own_prefix(device: Device) {
    let data = items(8, SLOT);
    let ring = SlotRing::new(device, RingOptions::new(4, SLOT)).unwrap();
    let pool = PackExecutor::new(2).unwrap();
    let mut foreign = ring.acquire().unwrap();
    foreign.bytes_mut()[..4].copy_from_slice(&[9, 8, 7, 6]);
    foreign.publish(SlotMeta::new(1000, SlotLayout::bytes(4))).unwrap();

    let wait = Duration::from_millis(30);
    let done = closing_after_patience(&ring, || ring.produce_timeout(&pool, 2, data.iter().map(fill), wait));
    assert!(matches!(done.result, Err(Error::Timeout { .. })), "{done:?}");
    assert_eq!(done.published, 3, "its own items, not the ring's");
    assert_eq!(ring.stats().published, 4);
    let at_once = closing_after_patience(&ring, || {
        ring.produce_timeout(&pool, 2, data[3..].iter().map(fill), Duration::ZERO)
    });
    assert!(matches!(at_once.result, Err(Error::Timeout { .. })), "{at_once:?}");
    assert_eq!(at_once.published, 0);
    assert_eq!(ring.stats().occupancy, 4, "a timed-out call kept a slot");

    let stream = Stream::new(device).unwrap();
    let first = ring.next_timeout(&stream, PATIENCE).unwrap();
    assert_eq!(first.meta().sequence, 1000);
    drop(first);
    let resumed = std::thread::scope(|s| {
        let consumer = s.spawn(|| consume(&ring, device, data.len(), &data));
        let rest = &data[done.published as usize..];
        let again = ring.produce_timeout(&pool, 2, rest.iter().map(fill), PATIENCE);
        assert_eq!(again.into_result().unwrap(), rest.len() as u64);
        consumer.join().unwrap()
    });
    assert_eq!(resumed, (0..8).collect::<Vec<u64>>());

    let mut bad = data.iter().take(3).map(fill).collect::<Vec<_>>();
    bad[2] = SlotFill::new(SlotMeta::new(2, SlotLayout::bytes(SLOT + 1)));
    let ended = ring.produce_timeout(&pool, 3, bad, PATIENCE);
    assert!(matches!(ended.result, Err(Error::InvalidArgument { .. })), "{ended:?}");
    assert_eq!(ended.published, 2);
    assert_eq!(consume(&ring, device, 2, &data), vec![0, 1]);
    assert_eq!(ring.stats().occupancy, 0);
}

/// The timeout also bounds the wait for a free host slot's last upload: a consumer's work
/// that never ends (held by a gate) keeps a released slot's next upload queued, so the call
/// after it finds its host slot busy and times out with nothing published and nothing kept;
/// once the work ends the same item goes through.
fn produce_timeout_bounds_the_wait_for_an_upload(device: Device) {
    let data = items(3, SLOT);
    let ring = SlotRing::new(device, RingOptions::new(1, SLOT)).unwrap();
    let pool = PackExecutor::new(2).unwrap();
    let stream = Stream::new(device).unwrap();
    let (open, gate) = std::sync::mpsc::channel::<()>();
    assert_eq!(ring.produce_timeout(&pool, 1, [fill(&data[0])], PATIENCE).into_result().unwrap(), 1);
    let slot = ring.next_timeout(&stream, PATIENCE).unwrap();
    check(&slot, &stream, &data);
    // The consumer's kernel, as it were: it runs until the gate opens (or the test gives up).
    stream
        .host_fn(move || {
            let _ = gate.recv_timeout(Duration::from_secs(30));
        })
        .unwrap();
    drop(slot); // released behind that work: item 1's upload waits for it
    assert_eq!(ring.produce_timeout(&pool, 1, [fill(&data[1])], PATIENCE).into_result().unwrap(), 1);
    let slot = ring.next_timeout(&stream, PATIENCE).unwrap(); // ordered behind its upload
    drop(slot);
    let wait = Duration::from_millis(30);
    let done = closing_after_patience(&ring, || ring.produce_timeout(&pool, 1, [fill(&data[2])], wait));
    match &done.result {
        Err(Error::Timeout { what, .. }) => assert!(what.contains("upload"), "{what}"),
        other => panic!("unexpected {other:?}"),
    }
    assert_eq!(done.published, 0);
    assert_eq!(ring.stats().occupancy, 0, "the timed-out slot was kept");
    open.send(()).unwrap();
    assert_eq!(ring.produce_timeout(&pool, 1, [fill(&data[2])], PATIENCE).into_result().unwrap(), 1);
    let slot = ring.next_timeout(&stream, PATIENCE).unwrap();
    assert_eq!(slot.meta().sequence, 2);
    check(&slot, &stream, &data);
}

/// The timeout bounds the wait on the consumers alone: the time this call spends publishing
/// its own pending fill (here a slow submission) does not count against the wait for the next
/// slot's host upload that follows it. The consumer's work ends 5 ms after the fill was
/// published, well inside the timeout counted from there, so the call succeeds; counted from
/// the moment the slot was reserved, the timeout had passed before the wait began.
fn produce_timeout_counts_only_the_wait_on_the_consumers(device: Device) {
    let data = items(4, SLOT);
    // Under compute-sanitizer (the GPU run's memcheck of this file) CUDA calls are many times
    // slower: the submission and the timeout grow together, keeping the timeout under it.
    let scale = if std::env::var("CUFERRY_UNDER_SANITIZER").as_deref() == Ok("1") { 10 } else { 1 };
    let (submitted, slow_done) = std::sync::mpsc::channel();
    let mut inner = StreamTransferBackend::new(device, false).unwrap();
    inner.allocate_host_slots(2, SLOT).unwrap();
    inner.allocate_device_slots(2, SLOT).unwrap();
    let backend = FlakyBackend::new(inner, usize::MAX).slow_submissions(
        3,
        Duration::from_millis(150 * scale),
        submitted,
    );
    let ring = SlotRing::with_backend(Box::new(backend)).unwrap();
    let consumer = Stream::new(device).unwrap();
    // Two items through, the second's upload and release queued behind the consumer's work
    // (a gate): one host slot is idle, the other's next upload waits for that work.
    let publish = |seq: u64| {
        let mut slot = ring.acquire().unwrap();
        slot.bytes_mut()[0] = seq as u8;
        slot.publish(SlotMeta::new(seq, SlotLayout::bytes(1))).unwrap();
    };
    publish(100);
    let taken = ring.next_timeout(&consumer, PATIENCE).unwrap();
    let gate = common::Gate::hold(&consumer);
    drop(taken);
    let (first, second) = (ring.acquire().unwrap(), ring.acquire().unwrap());
    drop(first);
    second.publish(SlotMeta::new(101, SlotLayout::bytes(1))).unwrap();
    drop(ring.next_timeout(&consumer, PATIENCE).unwrap());
    assert!(!gate.passed(), "the consumer's work ended early");
    let gate = &gate;
    std::thread::scope(|s| {
        s.spawn(move || {
            // The consumer's work ends 5 ms after this call's first item was submitted.
            slow_done.recv_timeout(PATIENCE).unwrap();
            std::thread::sleep(Duration::from_millis(5));
            gate.open();
        });
        let pool = PackExecutor::new(1).unwrap();
        let done =
            ring.produce_timeout(&pool, 2, data[..2].iter().map(fill), Duration::from_millis(75 * scale));
        assert_eq!(done.into_result().unwrap(), 2, "timed out counting its own publish as a wait");
    });
    for want in 0..2 {
        let slot = ring.next_timeout(&consumer, PATIENCE).unwrap();
        assert_eq!(slot.meta().sequence, want);
        check(&slot, &consumer, &data);
    }
}

on_both_backends! {
    lagging_iterator_gets_its_items_published => lagging_iterator_gets_its_items_published;
    uploads_waiting_for_a_busy_consumer => uploads_waiting_for_a_busy_consumer;
    streams_every_byte_in_order => streams_every_byte_in_order;
    consumer_holding_every_slot => consumer_holding_every_slot;
    two_producers_share_an_executor => two_producers_share_an_executor;
    bad_items_end_with_a_published_prefix => bad_items_end_with_a_published_prefix;
    close_mid_stream => close_mid_stream;
    failed_submission => failed_submission;
    panicking_iterator => panicking_iterator;
    produce_timeout_reports_its_own_prefix => produce_timeout_reports_its_own_prefix;
    produce_timeout_bounds_the_wait_for_an_upload => produce_timeout_bounds_the_wait_for_an_upload;
    produce_timeout_counts_only_the_wait_on_the_consumers => produce_timeout_counts_only_the_wait_on_the_consumers;
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]

    /// Random rings, windows, thread counts and slot sizes on the host backend: every piece
    /// arrives intact and in order.
    #[test]
    fn random_pipelines(
        depth in 1usize..6,
        ahead in 0usize..8,
        threads in 1usize..5,
        slot_kib in prop::sample::select(vec![4usize, 64, 200, 512]),
        count in 0u64..14,
    ) {
        let slot = slot_kib << 10;
        let data = items(count, slot);
        let ring = SlotRing::new(Device::Host, RingOptions::new(depth, slot)).unwrap();
        let pool = PackExecutor::new(threads).unwrap();
        let seen = std::thread::scope(|s| {
            let consumer = s.spawn(|| consume(&ring, Device::Host, data.len(), &data));
            prop_assert_eq!(ring.produce(&pool, ahead, data.iter().map(fill)).unwrap(), count);
            Ok(consumer.join().unwrap())
        })?;
        prop_assert_eq!(seen.len() as u64, count);
        prop_assert_eq!(ring.stats().occupancy, 0);
    }
}
