//! A transfer between the host and a GPU stages through pinned memory from the allocation
//! cache. That memory goes back to the cache once the copies through it finished, not when
//! the result is dropped: a weight placed on a GPU must not hold pinned host memory of its
//! own size for as long as it lives. Alone in its test binary, so that the cache counters
//! see no other test's allocations. Needs a GPU (the host backend stages nothing).

mod common;

use std::time::{Duration, Instant};

use common::cuda_device;
use cuferry::linop::{Array, Dims, Linop, ToDevice};
use cuferry::memory::cache_stats;
use cuferry::{Device, DeviceSpec};

/// Elements moved: 1 MiB of f64, a size class nothing else in this binary uses.
const LEN: usize = 1 << 17;

#[test]
fn transfer_staging_is_reused_while_the_first_result_lives() {
    let Some(device) = cuda_device() else { return };
    let (host, gpu) = (DeviceSpec::new(Device::Host).unwrap(), DeviceSpec::new(device).unwrap());
    let dims = Dims::new(&[("x", LEN)]).unwrap();
    let up = ToDevice::new(host.clone(), gpu.clone(), dims);
    let data: Vec<f64> = (0..LEN).map(|i| i as f64 * 0.5 - 7.0).collect();
    let x = Array::from_slice(&host, &[LEN], &data).unwrap();

    let first = up.apply(&x).unwrap();
    assert_eq!(first.to_vec().unwrap(), data);
    // The first staging buffer's copies have finished; the reaper gives it back to the cache
    // at its next poll, or the next allocation of its class reclaims it.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut reused_staging = false;
    let mut kept = vec![first];
    while !reused_staging && Instant::now() < deadline {
        let before = cache_stats();
        let next = up.apply(&x).unwrap();
        assert_eq!(next.to_vec().unwrap(), data);
        let after = cache_stats();
        // The device memory of `next` is fresh (every earlier result is kept alive), so a
        // reuse can only be a staging buffer given up by an earlier transfer.
        reused_staging = after.reused > before.reused;
        kept.push(next);
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        reused_staging,
        "no transfer reused an earlier one's staging while its result lived ({} results kept)",
        kept.len()
    );
}
