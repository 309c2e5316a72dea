//! [`HaloCommunicator`]: halo exchange between processes: pack, send and receive the packed
//! buffers without blocking, unpack.
//!
//! Rules:
//! - A link is one packed message: a send link packs from a local tile's arrays and sends the
//!   pack buffer to `peer` with `tag`; a receive link receives from `peer` with `tag` into its
//!   packer's unpack buffer and unpacks into a local tile's arrays. The two ends of a message
//!   are built from the same exchanges on both ranks (the sender uses their pack side, the
//!   receiver their unpack side), so the layouts agree by construction. [`HaloCommunicator::new`]
//!   matches both ends of every message across ranks (a send to each receive with its tag and
//!   byte count, and the reverse), and the byte count of every message is checked again when
//!   it lands.
//! - One `exchange` = post every receive, queue every pack at once, then (polling) send each
//!   pack buffer as soon as its pack finished (sends overlap the packing of later links) and
//!   queue each unpack as soon as its message landed; return when every message went out and
//!   every unpack finished. Every pack is queued before any unpack, and the arrays' trackers
//!   keep that order, so packs read the arrays as they were before the exchange (corners
//!   taken from halos see the old halos), exactly as a single-process pack-then-unpack. As
//!   there, no two unpack regions of one array may overlap, across links too (messages land
//!   in any order): checked before the first exchange posts anything, and again only when
//!   the arrays change.
//! - Memory handed to MPI: host-backend buffers always go straight to MPI; CUDA buffers go
//!   straight to MPI only when the MPI is CUDA-aware ([`cuda_aware_mpi`], or forced with
//!   [`Staging::Direct`]), otherwise through pinned staging buffers made once per link.
//! - Nothing hangs on a peer: waiting for MPI polls with a deadline
//!   ([`ExchangeOptions::timeout`], an [`Error::Timeout`] when it passes). The local waits for
//!   the packers' streams (a pack to finish before its send, an unpack before the exchange
//!   returns) are not bounded by it: a stalled local stream blocks like any synchronize. A rank whose exchange fails tells its peers (a message
//!   on a reserved tag of the communicator's private duplicate), and they return
//!   [`Error::PeerFailed`] instead of waiting for it. After any failure the communicator is
//!   closed ([`Error::Closed`] from then on): messages may still be in flight, so the buffers
//!   of those messages are leaked rather than freed under MPI (at most one step's message
//!   buffers and the notice, once), and when they were, its links are gone too
//!   ([`HaloCommunicator::sends`] is empty): everything else of theirs (streams and their
//!   threads, descriptor tables, the other buffers) is freed, so a caller that recovers by
//!   building a new communicator does not pile up threads.
//! - That promise starts at [`HaloCommunicator::new`], a collective every rank must reach: a
//!   rank that fails before calling it (building its packers, say) leaves the others blocked
//!   in it, as with any MPI collective. Build what can fail first, then call `new` everywhere.
//! - A message longer than its receive is an error ([`Error::Mpi`] from `MPI_Test`), never an
//!   abort; messages to self are checked when the links are built, because MPI may deliver a
//!   longer one cut short and would never deliver one that no receive takes: each send to self
//!   needs a receive from self with its tag and size, and the reverse.
//! - Tags are `0..MAX_TAG` (MPI guarantees at least 32767); a (peer, tag) pair names one
//!   message per direction, so it may appear once among the sends and once among the receives.

use std::collections::BTreeSet;
use std::time::{Duration, Instant};

use ::mpi::raw::AsRaw;
use ::mpi::topology::Communicator;

use super::raw::{self, PrivateComm, RawRequest};
use crate::copy::copy;
use crate::device::Device;
use crate::error::{Error, Result};
use crate::halo::{HaloExchange, HaloPacker};
use crate::memory::{DeviceBuffer, Element, PinnedBuffer};

/// Tags of links are below this; the communicator uses this tag for failure notices.
pub const MAX_TAG: i32 = 32767;

/// The tag of failure notices on the private communicator.
const ABORT_TAG: i32 = MAX_TAG;

/// Where CUDA buffers are when MPI reads or writes them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Staging {
    /// Directly when the MPI library reports CUDA support ([`cuda_aware_mpi`]), else staged.
    #[default]
    Auto,
    /// Device pointers go straight to MPI (a CUDA-aware MPI is the caller's promise).
    Direct,
    /// Through pinned host buffers, whatever the MPI supports.
    Host,
}

/// Whether the MPI library says it handles CUDA device pointers (`MPIX_Query_cuda_support`);
/// `false` when it says no (Open MPI built without CUDA, as Debian's 4.1 is, answers 0) or does
/// not say (the symbol is absent).
pub fn cuda_aware_mpi() -> bool {
    raw::query_cuda_support().unwrap_or(false)
}

/// Settings of a [`HaloCommunicator`].
#[derive(Clone, Copy, Debug)]
pub struct ExchangeOptions {
    /// How CUDA buffers reach MPI.
    pub staging: Staging,
    /// The longest one exchange waits for its peers before returning [`Error::Timeout`];
    /// `Duration::MAX` waits forever.
    pub timeout: Duration,
}

impl Default for ExchangeOptions {
    fn default() -> Self {
        ExchangeOptions { staging: Staging::Auto, timeout: Duration::from_secs(60) }
    }
}

/// One message of an exchange: its peer, tag, local tile and packer.
#[derive(Debug)]
pub struct HaloLink {
    peer: i32,
    tag: i32,
    tile: usize,
    packer: HaloPacker,
    /// The tile quantity of each of the packer's exchanges, when named
    /// ([`HaloLink::with_quantities`]); else quantity-major over every quantity.
    quantities: Option<Vec<usize>>,
}

impl HaloLink {
    /// A link with `peer` (a rank of the communicator) carrying `tag`, packing from or
    /// unpacking into the arrays of local tile `tile` (an index into the tiles passed to
    /// [`HaloCommunicator::exchange_tiles`]; 0 for [`HaloCommunicator::exchange`]).
    ///
    /// The packer's exchanges are taken as quantity-major over every quantity of the tile:
    /// with `q` arrays in the tile and `q * k` exchanges, `k` regions of quantity 0, then `k`
    /// of quantity 1, and so on. A link carrying only some quantities, or a different number
    /// of regions each, names them with [`HaloLink::with_quantities`].
    pub fn new(peer: i32, tag: i32, tile: usize, packer: HaloPacker) -> Self {
        HaloLink { peer, tag, tile, packer, quantities: None }
    }

    /// Names the tile quantity (an index into [`TileArrays::x`] and `y`) of each of the
    /// packer's exchanges, in the packer's order: `[0, 0, 2]` packs its first two regions
    /// from (or unpacks them into) quantity 0 and its third from quantity 2. An index past the
    /// tile's arrays fails the exchange.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] when the list's length is not the packer's number of
    /// exchanges.
    pub fn with_quantities(mut self, quantity_of_exchange: Vec<usize>) -> Result<Self> {
        if quantity_of_exchange.len() != self.packer.quantities() {
            return Err(Error::invalid(format!(
                "{} quantities named for a packer of {} exchanges",
                quantity_of_exchange.len(),
                self.packer.quantities()
            )));
        }
        self.quantities = Some(quantity_of_exchange);
        Ok(self)
    }

    /// The peer rank.
    pub fn peer(&self) -> i32 {
        self.peer
    }

    /// The message tag.
    pub fn tag(&self) -> i32 {
        self.tag
    }

    /// The local tile.
    pub fn tile(&self) -> usize {
        self.tile
    }

    /// The packer.
    pub fn packer(&self) -> &HaloPacker {
        &self.packer
    }
}

/// The arrays of one local tile: one per quantity (x components), and for a tile of vector
/// quantities their y components. A tile is all scalar or all vector: every link of a tile
/// has a scalar packer, or every one a vector packer (checked by [`HaloCommunicator::new`]);
/// exchange scalars and vectors as two tiles. Each region of quantity `q` (see
/// [`HaloLink::new`] and [`HaloLink::with_quantities`] for which that is) is packed from, or
/// unpacked into, `x[q]` (and `y[q]`).
#[derive(Clone, Copy, Debug)]
pub struct TileArrays<'a, T: Element> {
    /// The arrays (x components of vectors), one per quantity.
    pub x: &'a [&'a DeviceBuffer<T>],
    /// The y components, as many as `x`, for a tile of vector quantities; `None` for scalars.
    pub y: Option<&'a [&'a DeviceBuffer<T>]>,
}

/// Where the time of one exchange went, as consecutive intervals of the calling thread.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ExchangeTiming {
    /// From the start until every pack (and its staging copy) finished.
    pub pack: Duration,
    /// From then until every message was sent and received.
    pub transfer: Duration,
    /// From then until every unpack finished.
    pub unpack: Duration,
    /// Bytes sent.
    pub bytes_sent: usize,
    /// Bytes received.
    pub bytes_received: usize,
}

impl ExchangeTiming {
    /// The whole exchange.
    pub fn total(&self) -> Duration {
        self.pack + self.transfer + self.unpack
    }
}

/// The state of one link during an exchange.
#[derive(Debug)]
struct LinkState {
    link: HaloLink,
    /// Pinned staging of the message (CUDA links not handed to MPI directly).
    stage: Option<PinnedBuffer<u8>>,
    request: Option<RawRequest>,
    /// Where a send link is in the current exchange.
    phase: Phase,
}

/// The steps of a send link in one exchange.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// The pack is queued.
    Packing,
    /// The pack finished; its copy to the pinned stage is queued.
    Staging,
    /// The message is posted.
    Posted,
}

impl LinkState {
    fn pending(&self) -> bool {
        self.request.as_ref().is_some_and(|r| !r.is_done())
    }
}

/// Exchanges halos with other processes. See the [module docs](self).
#[derive(Debug)]
pub struct HaloCommunicator {
    comm: PrivateComm,
    sends: Vec<LinkState>,
    recvs: Vec<LinkState>,
    options: ExchangeOptions,
    direct_cuda: bool,
    closed: Option<Error>,
    /// The addresses of the receive links' unpack targets last checked for overlaps between
    /// links ([`HaloCommunicator::check_receive_overlaps`]).
    recv_checked: Option<Vec<usize>>,
}

impl HaloCommunicator {
    /// A communicator over a private duplicate of `comm` (so its tags never meet the
    /// caller's messages), sending through `sends` and receiving through `recvs`. Collective
    /// over `comm`: every rank calls it (with its own links), and a rank's bad links make the
    /// others fail too ([`Error::PeerFailed`]).
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a peer outside the communicator, a tag outside
    /// `0..MAX_TAG`, a (peer, tag) pair used twice in one direction, a message without its
    /// receive on the peer (or a receive without the peer's send, or of another size; to self
    /// too; the receiving rank reports it, its peers [`Error::PeerFailed`]), a tile whose
    /// links mix scalar and vector packers, a message longer than `i32::MAX` bytes (an MPI
    /// count is an `int`); [`Error::Mpi`] and allocation errors of the staging buffers.
    pub fn new(
        comm: &impl Communicator,
        sends: Vec<HaloLink>,
        recvs: Vec<HaloLink>,
        options: ExchangeOptions,
    ) -> Result<Self> {
        // Duplicate first (collective), then check: links differ between ranks, so a rank
        // whose links are bad must still reach the agreement the others wait in.
        let comm = PrivateComm::duplicate(comm);
        let direct_cuda = match options.staging {
            Staging::Auto => cuda_aware_mpi(),
            Staging::Direct => true,
            Staging::Host => false,
        };
        // Errors return first: the agreement below is checked on every rank, bad links or not.
        let built = raw::set_errors_return(comm.as_raw())
            .and_then(|()| Self::check_links(comm.rank(), comm.size(), &sends, &recvs))
            .and_then(|()| {
                let state = |link: HaloLink| -> Result<LinkState> {
                    let stage = match link.packer.device() {
                        Device::Cuda(_) if !direct_cuda => {
                            Some(PinnedBuffer::zeroed(link.packer.device(), link.packer.buffer_bytes())?)
                        }
                        _ => None,
                    };
                    Ok(LinkState { link, stage, request: None, phase: Phase::Posted })
                };
                let sends = sends.into_iter().map(state).collect::<Result<Vec<_>>>()?;
                let recvs = recvs.into_iter().map(state).collect::<Result<Vec<_>>>()?;
                Ok((sends, recvs))
            });
        raw::agree(&comm, built.as_ref().err(), "its halo links were rejected")?;
        let (sends, recvs) = built?;
        Self::match_peers(&comm, &sends, &recvs)?;
        Ok(HaloCommunicator { sends, recvs, comm, options, direct_cuda, closed: None, recv_checked: None })
    }

    /// Checks both ends of every message (collective over `comm`, once every rank's own links
    /// passed [`HaloCommunicator::check_links`]): each rank sends each peer the (tag, bytes)
    /// of its sends to it and checks them against its receives from that peer. A send that no
    /// receive takes would pile up unread at the peer every step, a receive that no send feeds
    /// would wait out the deadline, and a size that differs would fail the first exchange.
    /// The receiving rank returns the mismatch, the others [`Error::PeerFailed`].
    fn match_peers(comm: &PrivateComm, sends: &[LinkState], recvs: &[LinkState]) -> Result<()> {
        let size = usize::try_from(comm.size()).unwrap_or(0);
        let per_peer = |links: &[LinkState]| -> Vec<Vec<u64>> {
            let mut lists = vec![Vec::new(); size];
            for l in links {
                // Peers are ranks of `comm` and tags are non-negative (checked).
                lists[l.link.peer as usize].extend([l.link.tag as u64, l.link.packer.buffer_bytes() as u64]);
            }
            lists
        };
        let outgoing = per_peer(sends);
        let raw_comm = comm.as_raw();
        // Each fits an MPI count: a (peer, tag) pair is used once per direction and tags are
        // below MAX_TAG, so one peer gets at most 2 * MAX_TAG numbers.
        let send_counts: Vec<i32> = outgoing.iter().map(|l| l.len() as i32).collect();
        // A collective can fail on some ranks only (a truncated message fails its receiver):
        // the others go on to the next agreement, so a failing rank joins it with its error
        // instead of returning, and they fail with it rather than wait for it for ever.
        let recv_counts = match raw::all_to_all_counts(raw_comm, &send_counts) {
            Ok(counts) => counts,
            Err(e) => return raw::agree(comm, Some(&e), "its halo links could not be matched"),
        };
        // Their sums need not: agreed on, so every rank skips the exchange when one cannot.
        let recv_displs =
            match raw::displacements(&send_counts).and_then(|_| raw::displacements(&recv_counts)) {
                Ok((recv_displs, _)) => recv_displs,
                Err(_) => {
                    let e = Error::invalid(
                        "this rank's halo links are too many to match with its peers' in one MPI call",
                    );
                    return raw::agree(comm, Some(&e), "its halo links could not be matched");
                }
            };
        raw::agree(comm, None, "its halo links could not be matched")?;
        let received = match raw::all_to_all_v_u64(raw_comm, &outgoing.concat(), &send_counts, &recv_counts) {
            Ok(received) => received,
            Err(e) => return raw::agree(comm, Some(&e), "its halo links do not match its peers' links"),
        };
        let incoming = per_peer(recvs);
        let mismatch = (0..size).find_map(|peer| {
            let at = recv_displs[peer] as usize;
            let theirs: Vec<(u64, u64)> =
                received[at..at + recv_counts[peer] as usize].chunks_exact(2).map(|c| (c[0], c[1])).collect();
            let mine: Vec<(u64, u64)> = incoming[peer].chunks_exact(2).map(|c| (c[0], c[1])).collect();
            if let Some(&(tag, bytes)) = theirs.iter().find(|(t, b)| !mine.contains(&(*t, *b))) {
                return Some(match mine.iter().find(|(t, _)| *t == tag) {
                    Some((_, unpacks)) => format!(
                        "rank {peer} sends this rank {bytes} bytes with tag {tag}, but the receive link \
                         with it unpacks {unpacks}"
                    ),
                    None => format!(
                        "rank {peer} sends this rank {bytes} bytes with tag {tag}, but no receive link \
                         takes them (they would pile up unread every step)"
                    ),
                });
            }
            mine.iter().find(|(t, _)| !theirs.iter().any(|(u, _)| u == t)).map(|(tag, _)| {
                format!(
                    "this rank receives from rank {peer} with tag {tag}, but rank {peer} sends it nothing \
                     with that tag (the exchange would wait out its deadline)"
                )
            })
        });
        let mismatch = mismatch.map(Error::invalid);
        raw::agree(comm, mismatch.as_ref(), "its halo links do not match its peers' links")
    }

    fn check_links(me: i32, size: i32, sends: &[HaloLink], recvs: &[HaloLink]) -> Result<()> {
        for (what, links) in [("send", sends), ("receive", recvs)] {
            let mut seen = BTreeSet::new();
            for l in links {
                if i32::try_from(l.packer.buffer_bytes()).is_err() {
                    return Err(Error::invalid(format!(
                        "a {what} link with rank {} (tag {}) carries {} bytes; an MPI message holds at \
                         most i32::MAX (split the link's exchanges over several links)",
                        l.peer,
                        l.tag,
                        l.packer.buffer_bytes()
                    )));
                }
                if !(0..size).contains(&l.peer) {
                    return Err(Error::invalid(format!(
                        "a {what} link names rank {} of a communicator of {size}",
                        l.peer
                    )));
                }
                if !(0..MAX_TAG).contains(&l.tag) {
                    return Err(Error::invalid(format!(
                        "a {what} link has tag {}, outside 0..{MAX_TAG}",
                        l.tag
                    )));
                }
                if !seen.insert((l.peer, l.tag)) {
                    return Err(Error::invalid(format!(
                        "two {what} links with rank {} use tag {}: messages would be ambiguous",
                        l.peer, l.tag
                    )));
                }
            }
        }
        // A tile's arrays come with y components or without: its links cannot mix packers.
        let all = sends.iter().chain(recvs);
        for l in all.clone() {
            if let Some(other) =
                all.clone().find(|o| o.tile == l.tile && o.packer.is_vector() != l.packer.is_vector())
            {
                let kind = |v: bool| if v { "vector" } else { "scalar" };
                return Err(Error::invalid(format!(
                    "tile {} has links with {} and with {} packers (with rank {} tag {}, and rank {} tag {}); \
                     exchange scalar and vector quantities as two tiles",
                    l.tile,
                    kind(l.packer.is_vector()),
                    kind(other.packer.is_vector()),
                    l.peer,
                    l.tag,
                    other.peer,
                    other.tag
                )));
            }
        }
        // Messages to self are checked here: MPI may deliver a longer one cut short without an
        // error (Open MPI does), which the size check after the receive could not see.
        for r in recvs.iter().filter(|r| r.peer == me) {
            let send = sends.iter().find(|s| s.peer == me && s.tag == r.tag);
            match send.map(|s| s.packer.buffer_bytes()) {
                Some(bytes) if bytes == r.packer.buffer_bytes() => {}
                Some(bytes) => {
                    return Err(Error::invalid(format!(
                        "this rank sends itself {bytes} bytes with tag {}, but its receive unpacks {}",
                        r.tag,
                        r.packer.buffer_bytes()
                    )))
                }
                None => {
                    return Err(Error::invalid(format!(
                        "this rank receives from itself with tag {} but sends itself nothing with it",
                        r.tag
                    )))
                }
            }
        }
        // And a message to self that no receive takes would never be delivered: the exchange
        // would report success (a short send completes at once) or wait out its deadline.
        if let Some(s) =
            sends.iter().find(|s| s.peer == me && !recvs.iter().any(|r| r.peer == me && r.tag == s.tag))
        {
            return Err(Error::invalid(format!(
                "this rank sends itself {} bytes with tag {} but receives nothing from itself with it",
                s.packer.buffer_bytes(),
                s.tag
            )));
        }
        Ok(())
    }

    /// Whether CUDA buffers go straight to MPI (else through pinned staging).
    pub fn direct_cuda(&self) -> bool {
        self.direct_cuda
    }

    /// This process's rank.
    pub fn rank(&self) -> i32 {
        self.comm.rank()
    }

    /// The send links (none after a failure that leaked them: see the module rules).
    pub fn sends(&self) -> impl Iterator<Item = &HaloLink> {
        self.sends.iter().map(|s| &s.link)
    }

    /// The receive links (none after a failure that leaked them).
    pub fn receives(&self) -> impl Iterator<Item = &HaloLink> {
        self.recvs.iter().map(|s| &s.link)
    }

    /// Bytes one exchange sends (0 after a failure that leaked the links).
    pub fn bytes_sent(&self) -> usize {
        self.sends.iter().map(|s| s.link.packer.buffer_bytes()).sum()
    }

    /// The error that closed the communicator, if one did.
    pub fn closed_by(&self) -> Option<&Error> {
        self.closed.as_ref()
    }

    /// [`HaloCommunicator::exchange_tiles`] for one local tile.
    ///
    /// # Errors
    ///
    /// As [`HaloCommunicator::exchange_tiles`].
    pub fn exchange<T: Element>(
        &mut self,
        arrays_x: &[&DeviceBuffer<T>],
        arrays_y: Option<&[&DeviceBuffer<T>]>,
    ) -> Result<ExchangeTiming> {
        self.exchange_tiles(&[TileArrays { x: arrays_x, y: arrays_y }])
    }

    /// One exchange: packs every send link from its tile's arrays, sends and receives every
    /// message, unpacks every receive link into its tile's arrays; returns when the unpacks
    /// finished. Collective over the peers: each must call it once per step.
    ///
    /// # Errors
    ///
    /// [`Error::InvalidArgument`] for a link naming a missing tile, two receive links
    /// unpacking into overlapping regions of one array (or into one array with two specs;
    /// refused before anything is sent), the errors of [`HaloPacker::pack`] and
    /// [`HaloPacker::unpack`] (bad arrays), a message of the wrong
    /// size; [`Error::PeerFailed`] when a peer reported a failure; [`Error::Timeout`] when the
    /// peers did not complete in time; [`Error::Mpi`] and CUDA errors; [`Error::Closed`] once
    /// an exchange failed. A failure closes the communicator and tells the peers.
    pub fn exchange_tiles<T: Element>(&mut self, tiles: &[TileArrays<'_, T>]) -> Result<ExchangeTiming> {
        if let Some(e) = &self.closed {
            return Err(Error::Closed { reason: Some(Box::new(e.clone())) });
        }
        let result = self.run(tiles);
        if let Err(e) = &result {
            self.fail(e);
        }
        result
    }

    fn run<T: Element>(&mut self, tiles: &[TileArrays<'_, T>]) -> Result<ExchangeTiming> {
        let start = Instant::now();
        // A timeout too long to represent (`Duration::MAX`) waits forever.
        let deadline = start.checked_add(self.options.timeout);
        let comm = self.comm.as_raw();
        for s in self.sends.iter().chain(&self.recvs) {
            if s.link.tile >= tiles.len() {
                return Err(Error::invalid(format!(
                    "a link names tile {} but {} tiles were passed",
                    s.link.tile,
                    tiles.len()
                )));
            }
        }
        self.check_receive_overlaps(tiles)?;
        let mut timing = ExchangeTiming::default();
        // Receives first: no message has to wait as unexpected.
        for r in &mut self.recvs {
            // The receive's size is the buffer's own (the plan's size, which the unpack checks).
            let (ptr, bytes) = match &mut r.stage {
                Some(stage) => {
                    let stage = stage.as_mut_slice()?;
                    (stage.as_mut_ptr(), stage.len())
                }
                None => {
                    let buffer = r.link.packer.unpack_buffer_mut()?;
                    (buffer.as_mut_ptr(), buffer.len())
                }
            };
            // SAFETY: the buffer has `bytes` bytes and is idle (both accessors waited); nothing
            // else touches it until the request completes: the unpack that reads it is queued
            // after completion, and on failure the buffer is leaked (`fail`).
            r.request = Some(unsafe { RawRequest::recv(ptr, bytes, r.link.peer, r.link.tag, comm)? });
        }
        for s in &mut self.sends {
            let (x, y) = per_exchange(&s.link, &tiles[s.link.tile])?;
            s.link.packer.pack(&x, y.as_deref())?;
            s.phase = Phase::Packing;
            // A pack that already finished (host packs may run on this thread) goes out now,
            // while the next link packs.
            timing.bytes_sent += advance_send(s, comm)?.unwrap_or(0);
        }
        let mut packed = false;
        let mut idle_polls = 0u32;
        loop {
            let mut progress = false;
            for s in &mut self.sends {
                let before = s.phase;
                if let Some(bytes) = advance_send(s, comm)? {
                    timing.bytes_sent += bytes;
                }
                progress |= s.phase != before;
            }
            if !packed && self.sends.iter().all(|s| s.phase == Phase::Posted) {
                packed = true;
                timing.pack = start.elapsed();
            }
            for s in &mut self.sends {
                if let Some(req) = &mut s.request {
                    if !req.is_done() && req.test()?.is_some() {
                        progress = true;
                    }
                }
            }
            for r in &mut self.recvs {
                let Some(req) = &mut r.request else { continue };
                if req.is_done() {
                    continue;
                }
                let Some(got) = req.test()? else { continue };
                let want = r.link.packer.buffer_bytes();
                if got != want {
                    return Err(Error::invalid(format!(
                        "rank {} sent {got} bytes with tag {}, but this link unpacks {want}",
                        r.link.peer, r.link.tag
                    )));
                }
                timing.bytes_received += got;
                let stream = r.link.packer.stream().clone();
                if let Some(stage) = &r.stage {
                    copy(&stream, stage, r.link.packer.unpack_buffer_mut()?)?;
                }
                let (x, y) = per_exchange(&r.link, &tiles[r.link.tile])?;
                r.link.packer.unpack(&x, y.as_deref())?;
                progress = true;
            }
            // Before the "all done" test: a rank whose messages all complete at once still
            // reads a peer's failure notice (at the latest on its next exchange).
            if let Some(from) = raw::probe_any(ABORT_TAG, comm)? {
                let notice = raw::recv_probed(from, ABORT_TAG, comm)?;
                return Err(read_notice(from, &notice));
            }
            let sent = self.sends.iter().all(|s| s.phase == Phase::Posted && !s.pending());
            let received = self.recvs.iter().all(|r| !r.pending());
            if sent && received {
                break;
            }
            if deadline.is_some_and(|d| Instant::now() >= d) {
                return Err(Error::Timeout {
                    what: "a halo exchange: a peer did not send or receive in time",
                    waited: start.elapsed(),
                });
            }
            idle_polls = if progress { 0 } else { idle_polls.saturating_add(1) };
            back_off(idle_polls);
        }
        let transferred = start.elapsed();
        if !packed {
            timing.pack = transferred;
        }
        timing.transfer = transferred.saturating_sub(timing.pack);
        for r in &self.recvs {
            r.link.packer.synchronize()?;
        }
        timing.unpack = start.elapsed().saturating_sub(transferred);
        for s in self.sends.iter_mut().chain(self.recvs.iter_mut()) {
            s.request = None;
        }
        Ok(timing)
    }

    /// Closes the communicator after `err`: tells every peer, abandons pending requests, and
    /// leaks the buffers MPI may still access.
    /// Rejects two receive links that unpack into overlapping regions of one array, or into
    /// one array with two specs: their messages land in any order, so the cells would hold
    /// whichever came last. Within one link its packer refuses this; across links only this
    /// check sees it. Checked before anything is posted, again only when the arrays change.
    fn check_receive_overlaps<T: Element>(&mut self, tiles: &[TileArrays<'_, T>]) -> Result<()> {
        // (array address, receive link, exchange) of every unpack target.
        let mut targets: Vec<(usize, usize, &HaloExchange)> = Vec::new();
        for (i, r) in self.recvs.iter().enumerate() {
            let (x, y) = per_exchange(&r.link, &tiles[r.link.tile])?;
            let packer = &r.link.packer;
            targets.extend(x.iter().zip(packer.exchanges_x()).map(|(a, ex)| (a.as_ptr() as usize, i, ex)));
            if let (Some(y), Some(ey)) = (y, packer.exchanges_y()) {
                targets.extend(y.iter().zip(ey).map(|(a, ex)| (a.as_ptr() as usize, i, ex)));
            }
        }
        let key: Vec<usize> = targets.iter().map(|t| t.0).collect();
        if self.recv_checked.as_ref() == Some(&key) {
            return Ok(());
        }
        for (n, &(addr_a, link_a, ea)) in targets.iter().enumerate() {
            for &(addr_b, link_b, eb) in &targets[n + 1..] {
                if addr_a != addr_b || link_a == link_b {
                    continue;
                }
                let (la, lb) = (&self.recvs[link_a].link, &self.recvs[link_b].link);
                let links = format!(
                    "the receive links from rank {} (tag {}) and rank {} (tag {})",
                    la.peer, la.tag, lb.peer, lb.tag
                );
                if ea.spec() != eb.spec() {
                    return Err(Error::invalid(format!(
                        "{links} unpack into one array with different specs"
                    )));
                }
                if ea.unpack_overlaps(eb) {
                    return Err(Error::invalid(format!(
                        "{links} unpack into overlapping regions {:?} and {:?} of one array (the \
                         later message would win)",
                        ea.unpack_region(),
                        eb.unpack_region()
                    )));
                }
            }
        }
        self.recv_checked = Some(key);
        Ok(())
    }

    fn fail(&mut self, err: &Error) {
        self.closed = Some(err.clone());
        let comm = self.comm.as_raw();
        let me = self.comm.rank();
        let peers: BTreeSet<i32> =
            self.sends.iter().chain(&self.recvs).map(|s| s.link.peer).filter(|&p| p != me).collect();
        // Forwarded too (a peer's failure), so that every rank connected to the failing one
        // through any chain of links hears of it instead of timing out.
        let notice: &'static [u8] = Box::leak(write_notice(me, err).into_boxed_slice());
        for p in peers {
            // Best effort: a peer that is gone cannot be told.
            let _ = raw::send_and_forget(notice, p, ABORT_TAG, comm);
        }
        self.drop_requests();
    }

    /// Cancels and frees every request (their `Drop`). When one may still have been in flight,
    /// the links go: the buffer MPI may still read or write for a pending request (its pinned
    /// stage, or its packer's buffers) is leaked, and the rest of every link is dropped.
    fn drop_requests(&mut self) {
        let in_flight = self.sends.iter().chain(&self.recvs).any(LinkState::pending);
        if !in_flight {
            for s in self.sends.iter_mut().chain(self.recvs.iter_mut()) {
                s.request = None;
            }
            return;
        }
        for mut s in self.sends.drain(..).chain(self.recvs.drain(..)) {
            if s.pending() {
                match s.stage.take() {
                    Some(stage) => stage.leak(),
                    None => s.link.packer.leak_buffers(),
                }
            }
            s.request = None;
        }
    }
}

impl Drop for HaloCommunicator {
    /// Requests are pending here only when a panic unwound out of an exchange: their buffers
    /// are then leaked, as a failure leaks them, rather than freed under MPI.
    fn drop(&mut self) {
        self.drop_requests();
    }
}

/// Moves a send link on when its pack (or staging copy) finished: queues the copy to the
/// pinned stage, or posts the message. Returns the bytes posted, if it posted.
fn advance_send(s: &mut LinkState, comm: ::mpi::ffi::MPI_Comm) -> Result<Option<usize>> {
    if s.phase == Phase::Posted || !s.link.packer.ready()? {
        return Ok(None);
    }
    if let (Phase::Packing, Some(stage)) = (s.phase, &mut s.stage) {
        // The pack finished: copy it to the pinned stage (`ready` again after it).
        copy(s.link.packer.stream(), s.link.packer.pack_buffer()?, stage)?;
        s.phase = Phase::Staging;
        return Ok(None);
    }
    let bytes = s.link.packer.buffer_bytes();
    let ptr = match &s.stage {
        Some(stage) => stage.as_slice()?.as_ptr(),
        None => s.link.packer.pack_buffer()?.as_ptr(),
    };
    // SAFETY: the packed bytes (or their staged copy) are complete (`ready`, and the accessors
    // waited) and nothing writes them until the send completes: the next pack is queued by the
    // next exchange, which starts after this one's sends completed; on failure the buffer is
    // leaked (`fail`).
    s.request = Some(unsafe { RawRequest::send(ptr, bytes, s.link.peer, s.link.tag, comm)? });
    s.phase = Phase::Posted;
    Ok(Some(bytes))
}

/// The packer's array lists for a tile: the quantity of each exchange as the link names it
/// ([`HaloLink::with_quantities`]), else quantity-major over every quantity (`k` regions of
/// quantity 0, then `k` of quantity 1, ...); the tile has one array per quantity.
#[allow(clippy::type_complexity)]
fn per_exchange<'a, T: Element>(
    link: &HaloLink,
    tile: &TileArrays<'a, T>,
) -> Result<(Vec<&'a DeviceBuffer<T>>, Option<Vec<&'a DeviceBuffer<T>>>)> {
    let exchanges = link.packer.quantities();
    let quantities = tile.x.len();
    let quantity_of: Vec<usize> = match &link.quantities {
        Some(named) => {
            if let Some(&q) = named.iter().find(|&&q| q >= quantities) {
                return Err(Error::invalid(format!(
                    "a link names quantity {q} of tile {}, which has {quantities} arrays",
                    link.tile
                )));
            }
            named.clone()
        }
        None => {
            if quantities == 0 || exchanges % quantities != 0 {
                return Err(Error::invalid(format!(
                    "tile {} has {quantities} arrays but the link's packer has {exchanges} exchanges \
                     (not a multiple; name each exchange's quantity with HaloLink::with_quantities)",
                    link.tile
                )));
            }
            let regions = exchanges / quantities;
            (0..exchanges).map(|i| i / regions).collect()
        }
    };
    let expand = |arrays: &[&'a DeviceBuffer<T>]| -> Vec<&'a DeviceBuffer<T>> {
        quantity_of.iter().map(|&q| arrays[q]).collect()
    };
    let y = match tile.y {
        Some(y) if y.len() != quantities => {
            return Err(Error::invalid(format!(
                "tile {} has {quantities} x arrays but {} y arrays",
                link.tile,
                y.len()
            )))
        }
        Some(y) => Some(expand(y)),
        None => None,
    };
    Ok((expand(tile.x), y))
}

/// A failure notice: the rank where the failure began, a newline, what happened there.
fn write_notice(me: i32, err: &Error) -> Vec<u8> {
    match err {
        Error::PeerFailed { rank, what } => format!("{rank}\n{what}"),
        other => format!("{me}\n{other}"),
    }
    .into_bytes()
}

/// The error a notice from rank `from` stands for.
fn read_notice(from: i32, notice: &[u8]) -> Error {
    let text = String::from_utf8_lossy(notice);
    match text.split_once('\n').and_then(|(r, w)| Some((r.parse::<i32>().ok()?, w))) {
        Some((rank, what)) => Error::PeerFailed { rank, what: what.to_owned() },
        None => Error::PeerFailed { rank: from, what: text.into_owned() },
    }
}

/// Polls spin briefly, then yield, then sleep a little: ranks may share cores (oversubscribed
/// runs), and a spinning rank would starve the one it waits for.
fn back_off(idle_polls: u32) {
    match idle_polls {
        0..=64 => std::hint::spin_loop(),
        65..=1024 => std::thread::yield_now(),
        _ => std::thread::sleep(Duration::from_micros(50)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::halo::{ElementType, HaloExchange, HaloSpec, HorizontalDims};
    use crate::stream::Stream;

    /// A 4 x 6 f64 array (y, x) and its east column sent into column 0.
    fn east_exchange() -> HaloExchange {
        let spec = HaloSpec::contiguous(ElementType::F64, &[4, 6], HorizontalDims::xy(1, 0)).unwrap();
        HaloExchange::new(&spec, &[0..4, 4..5], 0, &[0..4, 0..1]).unwrap()
    }

    fn packer(exchanges: usize, vector: bool) -> HaloPacker {
        let list = vec![east_exchange(); exchanges];
        HaloPacker::new(Device::Host, &list, vector.then_some(&list[..])).unwrap()
    }

    /// A tile whose links mix scalar and vector packers cannot be exchanged (its arrays come
    /// with y components or without): refused when the links are built, not at every exchange.
    #[test]
    fn a_tile_mixing_scalar_and_vector_links_is_refused() {
        let sends = vec![HaloLink::new(1, 0, 0, packer(1, false)), HaloLink::new(1, 1, 0, packer(1, true))];
        let err = HaloCommunicator::check_links(0, 2, &sends, &[]).unwrap_err();
        assert!(matches!(&err, Error::InvalidArgument { what } if what.contains("tile 0")), "{err:?}");
        // Across directions too.
        let sends = vec![HaloLink::new(1, 0, 0, packer(1, false))];
        let recvs = vec![HaloLink::new(1, 0, 0, packer(1, true))];
        assert!(HaloCommunicator::check_links(0, 2, &sends, &recvs).is_err());
        // Scalars and vectors as two tiles are fine.
        let sends = vec![HaloLink::new(1, 0, 0, packer(1, false)), HaloLink::new(1, 1, 1, packer(1, true))];
        HaloCommunicator::check_links(0, 2, &sends, &[]).unwrap();
    }

    /// A message longer than an MPI count (`int`) is refused when the links are built, on the
    /// rank that has it (its peers hear of it through the agreement), not at the first exchange.
    #[test]
    fn a_message_past_the_mpi_count_is_refused_when_links_are_built() {
        let row = 1usize << 31; // i32::MAX + 1 bytes
        let spec = HaloSpec::contiguous(ElementType::U8, &[2, row], HorizontalDims::xy(1, 0)).unwrap();
        let ex = HaloExchange::new(&spec, &[0..1, 0..row], 0, &[1..2, 0..row]).unwrap();
        // The packer's buffers are zeroed host memory never touched: address space only.
        let big = HaloPacker::new(Device::Host, &[ex], None).unwrap();
        assert_eq!(big.buffer_bytes(), row);
        let err = HaloCommunicator::check_links(0, 2, &[HaloLink::new(1, 0, 0, big)], &[]).unwrap_err();
        assert!(matches!(&err, Error::InvalidArgument { what } if what.contains("i32::MAX")), "{err:?}");
        drop(err);
        // Its buffers went back to the pool when the links were dropped: free them (2 GiB of
        // address space) without clearing keys other tests are using.
        crate::halo::pool::clear_key(Device::Host, row);
    }

    /// Without names, exchanges are quantity-major over every quantity; a link carrying only
    /// some quantities names them, and each exchange then reads the array it names (the
    /// inference would have mapped a 2-exchange link over a 2-array tile to both arrays).
    #[test]
    fn exchanges_map_to_the_quantities_the_link_names() {
        let stream = Stream::new(Device::Host).unwrap();
        let a = DeviceBuffer::<f64>::zeroed(&stream, 24).unwrap();
        let b = DeviceBuffer::<f64>::zeroed(&stream, 24).unwrap();
        let c = DeviceBuffer::<f64>::zeroed(&stream, 24).unwrap();
        let tile = TileArrays { x: &[&a, &b, &c], y: None };
        let ptrs = |v: Vec<&DeviceBuffer<f64>>| v.iter().map(|d| d.as_ptr()).collect::<Vec<_>>();

        let inferred = HaloLink::new(1, 0, 0, packer(6, false));
        let (x, y) = per_exchange(&inferred, &tile).unwrap();
        assert_eq!(ptrs(x), [a.as_ptr(), a.as_ptr(), b.as_ptr(), b.as_ptr(), c.as_ptr(), c.as_ptr()]);
        assert!(y.is_none());

        let named = HaloLink::new(1, 0, 0, packer(3, false)).with_quantities(vec![0, 0, 2]).unwrap();
        let (x, _) = per_exchange(&named, &tile).unwrap();
        assert_eq!(ptrs(x), [a.as_ptr(), a.as_ptr(), c.as_ptr()]);

        // A name past the tile's arrays fails the exchange; a list of the wrong length, the link.
        let past = HaloLink::new(1, 0, 0, packer(2, false)).with_quantities(vec![0, 3]).unwrap();
        assert!(matches!(per_exchange(&past, &tile), Err(Error::InvalidArgument { .. })));
        let short = HaloLink::new(1, 0, 0, packer(2, false)).with_quantities(vec![0]);
        assert!(matches!(short, Err(Error::InvalidArgument { .. })));
        // Unnamed, a count that is no multiple of the tile's arrays is refused.
        let odd = HaloLink::new(1, 0, 0, packer(2, false));
        assert!(matches!(per_exchange(&odd, &tile), Err(Error::InvalidArgument { .. })));
    }
}
