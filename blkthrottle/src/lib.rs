//! corral-blkthrottle (work in progress)
