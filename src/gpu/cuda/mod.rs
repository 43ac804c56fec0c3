//! The one layer over CUDA's C APIs: every raw call into libcuda (`cudarc::driver::sys`) and
//! libnvrtc (`cudarc::nvrtc::sys`) in the crate is in this module, nowhere else.
//!
//! It follows cudarc's own `sys → result → safe` layering: cudarc's `sys` is the raw
//! bindings; [`driver`] and [`nvrtc`] here are the result layer, small functions that make one
//! call each and turn its status into the crate's [`Error`](crate::error::Error) (naming the
//! call as every caller named it before); the rest of `gpu/` is the safe layer (contexts,
//! reducers, staging pools, direct regions, doorbells, the kernel cache). A function is `unsafe`
//! only where its soundness rests on the caller (device addresses and raw host pointers it
//! cannot check); its `# Safety` section says what the caller guarantees.
//!
//! cudarc loads both libraries at run time and *panics* on a missing library or symbol, so
//! the presence checks live here too ([`driver::libcuda_present`],
//! [`driver::require_driver_symbols`], [`nvrtc::libnvrtc_present`]): a driver function may
//! be called only after its symbol was checked (the callers check once per object, when it is
//! created, as they always did); NVRTC functions check the library themselves.

pub(crate) mod driver;
pub(crate) mod nvrtc;
