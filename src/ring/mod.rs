//! The slot ring: streaming host data to a device through pinned slots (work in progress).
