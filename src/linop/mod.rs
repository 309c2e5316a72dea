//! Named linear operators split into tiles across devices (work in progress).
