//! corral-scheduler (work in progress)
