//! Halo pack/unpack: many arrays into one buffer (work in progress).
