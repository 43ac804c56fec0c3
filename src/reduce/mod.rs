//! CPU reduction kernels (placeholder; see the reduce work item).
