//! Thin, checked wrappers over the CUDA driver calls the backend makes:
//! every call's status becomes a `BackendError` naming what failed.

use akunu_core::backend::BackendError;
use cudarc::driver::sys;
use std::ffi::c_void;

pub type Dptr = sys::CUdeviceptr;

pub fn check(r: sys::CUresult, what: &str) -> Result<(), BackendError> {
    r.result()
        .map_err(|e| BackendError::Device(format!("{what}: {e}")))
}

/// Whether a CUDA driver can be used on this machine, and if not, why.
/// Never panics (cudarc's context constructor does without a driver).
pub fn driver_status() -> Result<i32, String> {
    // SAFETY: probing for the shared library has no preconditions.
    if !unsafe { sys::is_culib_present() } {
        return Err("no CUDA driver (libcuda.so) found".into());
    }
    // SAFETY: the library is present; cuInit may be called repeatedly.
    unsafe {
        sys::cuInit(0)
            .result()
            .map_err(|e| format!("the CUDA driver did not initialise: {e}"))?;
        let mut n = 0;
        sys::cuDeviceGetCount(&mut n)
            .result()
            .map_err(|e| format!("cannot count CUDA devices: {e}"))?;
        if n == 0 {
            return Err("the CUDA driver reports no devices".into());
        }
        let mut v = 0;
        sys::cuDriverGetVersion(&mut v)
            .result()
            .map_err(|e| format!("cannot read the CUDA driver version: {e}"))?;
        Ok(v)
    }
}

/// A device allocation.
pub fn alloc(bytes: u64, what: &str) -> Result<Dptr, BackendError> {
    let mut p: Dptr = 0;
    // SAFETY: out-parameter; a zero-byte request is rounded up to 256 so
    // every buffer has a distinct, valid address.
    let r = unsafe { sys::cuMemAlloc_v2(&mut p, bytes.max(256) as usize) };
    if r == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        return Err(BackendError::OutOfMemory {
            bytes,
            what: what.to_string(),
        });
    }
    check(r, &format!("allocating {bytes} bytes for {what}"))?;
    Ok(p)
}

/// Pinned host memory that the device can read and write directly
/// (zero-copy): the device writes tokens into it as it produces them.
pub struct HostMapped {
    pub host: *mut u8,
    pub dev: Dptr,
    pub bytes: usize,
}

impl HostMapped {
    pub fn new(bytes: usize) -> Result<HostMapped, BackendError> {
        let mut host: *mut c_void = std::ptr::null_mut();
        let mut dev: Dptr = 0;
        // SAFETY: out-parameters; `host` is checked before use and freed in
        // Drop; the device alias comes from the same allocation.
        unsafe {
            check(
                sys::cuMemHostAlloc(
                    &mut host,
                    bytes.max(64),
                    sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE,
                ),
                "allocating host-mapped memory",
            )?;
            std::ptr::write_bytes(host as *mut u8, 0, bytes.max(64));
            check(
                sys::cuMemHostGetDevicePointer_v2(&mut dev, host, 0),
                "mapping host memory into the device",
            )?;
        }
        Ok(HostMapped {
            host: host as *mut u8,
            dev,
            bytes,
        })
    }
}

impl Drop for HostMapped {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemHostAlloc in `new`, freed once here.
        unsafe {
            sys::cuMemFreeHost(self.host as *mut c_void);
        }
    }
}

pub struct Event(pub sys::CUevent);

// SAFETY: an event handle is a driver object usable from any thread that has
// the context bound; `Event` owns it exclusively (destroyed once, in Drop).
unsafe impl Send for Event {}

impl Event {
    pub fn new() -> Result<Event, BackendError> {
        let mut e: sys::CUevent = std::ptr::null_mut();
        // SAFETY: out-parameter.
        check(
            unsafe { sys::cuEventCreate(&mut e, sys::CUevent_flags::CU_EVENT_DEFAULT as u32) },
            "creating an event",
        )?;
        Ok(Event(e))
    }

    pub fn record(&self, stream: sys::CUstream) -> Result<(), BackendError> {
        // SAFETY: both handles are live.
        check(
            unsafe { sys::cuEventRecord(self.0, stream) },
            "recording an event",
        )
    }

    /// Records the event as a node of the graph being captured on `stream`
    /// (a plain record during capture only orders work, it times nothing).
    pub fn record_in_capture(&self, stream: sys::CUstream) -> Result<(), BackendError> {
        // SAFETY: both handles are live.
        check(
            unsafe {
                sys::cuEventRecordWithFlags(
                    self.0,
                    stream,
                    sys::CUevent_record_flags::CU_EVENT_RECORD_EXTERNAL as u32,
                )
            },
            "recording an event in a graph",
        )
    }

    /// Milliseconds from `self` to `end` (both recorded and complete).
    pub fn ms_to(&self, end: &Event) -> Result<f32, BackendError> {
        let mut ms = 0f32;
        // SAFETY: both events are live; completion is the caller's (the
        // call fails cleanly otherwise).
        check(
            unsafe { sys::cuEventElapsedTime_v2(&mut ms, self.0, end.0) },
            "reading an event time",
        )?;
        Ok(ms)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: created in `new`, destroyed once.
        unsafe {
            sys::cuEventDestroy_v2(self.0);
        }
    }
}
