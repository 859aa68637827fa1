"""An engine's side of CUDA IPC on the project's fake driver
(tests/fakes/fake_cuda.c, KVTIER_FAKE_CUDA: its libcuda.so.1), through the
driver API as torch calls it underneath: device memory, its IPC handle,
interprocess events recorded on the engine's stream, a late "kernel" that
writes KV as a forward pass does.  For tests/lmcache's GPU descriptor
tests: kvtierd, given the same fake (KVTIER_CUDA_LIBRARY), opens these
handles in its own process.  FakeHip: the same on ROCm, through HIP as
torch's ROCm build calls it (tests/fakes/fake_hip.c on the fake HSA,
KVTIER_FAKE_HIP)."""
import ctypes
import os

CU_EVENT_DISABLE_TIMING = 0x2
CU_EVENT_INTERPROCESS = 0x4


class CudaError(RuntimeError):
    pass


class IpcHandle(ctypes.Structure):
    """CUipcEventHandle / CUipcMemHandle: 64 bytes, passed by value."""
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


class FakeCuda:
    def __init__(self, device=0, path=None):
        self.lib = ctypes.CDLL(path or os.environ["KVTIER_FAKE_CUDA"])
        gpa = self.lib.cuGetProcAddress_v2
        gpa.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                        ctypes.c_uint64, ctypes.c_void_p]
        self._gpa = gpa
        self.call("cuInit", 2000, ctypes.c_uint)(0)
        self.dev = ctypes.c_int()
        self.call("cuDeviceGet", 2000, ctypes.c_void_p, ctypes.c_int)(
            ctypes.byref(self.dev), device)
        ctx = ctypes.c_void_p()
        self.call("cuDevicePrimaryCtxRetain", 7000, ctypes.c_void_p, ctypes.c_int)(
            ctypes.byref(ctx), self.dev)
        self.call("cuCtxPushCurrent", 4000, ctypes.c_void_p)(ctx)
        self.lib.kvt_fake_cuda_engine_stream.restype = ctypes.c_void_p
        self.stream = self.lib.kvt_fake_cuda_engine_stream()
        self.lib.kvt_fake_cuda_kernel_write.argtypes = [
            ctypes.c_void_p, ctypes.c_uint64, ctypes.c_int, ctypes.c_uint64, ctypes.c_uint]

    def call(self, name, version, *argtypes):
        """The driver's entry point as cuGetProcAddress gives it; raises
        on an error code."""
        p = ctypes.c_void_p()
        if self._gpa(name.encode(), ctypes.byref(p), 13000, 0, None) or not p.value:
            raise CudaError("no %s in the driver" % name)
        fn = ctypes.CFUNCTYPE(ctypes.c_int, *argtypes)(p.value)

        def checked(*args):
            r = fn(*args)
            if r:
                raise CudaError("%s: CUresult %d" % (name, r))
        return checked

    def uuid(self):
        """torch's str(get_device_properties(i).uuid): 8-4-4-4-12 hex."""
        b = (ctypes.c_ubyte * 16)()
        self.call("cuDeviceGetUuid", 11040, ctypes.c_void_p, ctypes.c_int)(b, self.dev)
        h = bytes(b).hex()
        return "-".join((h[:8], h[8:12], h[12:16], h[16:20], h[20:]))

    def alloc(self, n):
        p = ctypes.c_uint64()
        self.call("cuMemAlloc", 3020, ctypes.c_void_p, ctypes.c_size_t)(ctypes.byref(p), n)
        return p.value

    def write(self, dev, data):
        self.call("cuMemcpyHtoD", 3020, ctypes.c_uint64, ctypes.c_char_p, ctypes.c_size_t)(
            dev, data, len(data))

    def read(self, dev, n):
        buf = ctypes.create_string_buffer(n)
        self.call("cuMemcpyDtoH", 3020, ctypes.c_void_p, ctypes.c_uint64, ctypes.c_size_t)(
            buf, dev, n)
        return buf.raw

    def mem_handle(self, dev):
        h = (ctypes.c_ubyte * 64)()
        self.call("cuIpcGetMemHandle", 4010, ctypes.c_void_p, ctypes.c_uint64)(h, dev)
        return bytes(h)

    def event(self):
        """A new interprocess event recorded on the engine's stream now
        (after the work queued there), and its handle."""
        ev = ctypes.c_void_p()
        self.call("cuEventCreate", 2000, ctypes.c_void_p, ctypes.c_uint)(
            ctypes.byref(ev), CU_EVENT_INTERPROCESS | CU_EVENT_DISABLE_TIMING)
        self.call("cuEventRecord", 2000, ctypes.c_void_p, ctypes.c_void_p)(ev, self.stream)
        h = (ctypes.c_ubyte * 64)()
        self.call("cuIpcGetEventHandle", 4010, ctypes.c_void_p, ctypes.c_void_p)(h, ev)
        return ev, bytes(h)

    def wait_ipc_event(self, handle):
        """What the engine does with the server's completion event: its
        stream waits for it, then the host waits for the stream."""
        ev = ctypes.c_void_p()
        self.call("cuIpcOpenEventHandle", 4010, ctypes.c_void_p, IpcHandle)(
            ctypes.byref(ev), IpcHandle((ctypes.c_ubyte * 64)(*handle)))
        self.call("cuStreamWaitEvent", 3020, ctypes.c_void_p, ctypes.c_void_p,
                  ctypes.c_uint)(self.stream, ev, 0)
        self.call("cuEventDestroy", 4000, ctypes.c_void_p)(ev)
        self.call("cuStreamSynchronize", 2000, ctypes.c_void_p)(self.stream)

    def sem_record(self, words=4096):
        """A timeline semaphore's record, as LMCache's isolated-IPC events
        make it: the next value written into the process's word (slot 1 of
        a buffer of `words` 8-byte words, zero at first) on the engine's
        stream behind its work.  (buffer's IPC handle, offset, value)"""
        if not getattr(self, "sem", None):
            self.sem = self.alloc(words * 8)
            self.write(self.sem, bytes(words * 8))
            self.sem_handle, self.sem_seq = self.mem_handle(self.sem), 0
        self.sem_seq += 1
        self.call("cuStreamWriteValue64", 11070, ctypes.c_void_p, ctypes.c_uint64,
                  ctypes.c_uint64, ctypes.c_uint)(self.stream, self.sem + 8, self.sem_seq, 0)
        return self.sem_handle, 8, self.sem_seq

    def sem_wait(self, handle, offset, value):
        """The engine's stream waits until another process's word reaches
        value (GEQ), then the host waits for the stream."""
        p = ctypes.c_uint64()
        self.call("cuIpcOpenMemHandle", 11000, ctypes.c_void_p, IpcHandle, ctypes.c_uint)(
            ctypes.byref(p), IpcHandle((ctypes.c_ubyte * 64)(*handle)), 1)
        self.call("cuStreamWaitValue64", 11070, ctypes.c_void_p, ctypes.c_uint64,
                  ctypes.c_uint64, ctypes.c_uint)(self.stream, p.value + offset, value, 0)
        self.call("cuStreamSynchronize", 2000, ctypes.c_void_p)(self.stream)
        self.call("cuIpcCloseMemHandle", 4010, ctypes.c_uint64)(p.value)

    def kernel_write(self, dev, byte, n, delay_us):
        """A forward pass writing n bytes at dev late, on the engine's stream."""
        if self.lib.kvt_fake_cuda_kernel_write(self.stream, dev, byte, n, delay_us):
            raise CudaError("kvt_fake_cuda_kernel_write")


HIP_MEMCPY_H2D, HIP_MEMCPY_D2H = 1, 2
HIP_EVENT_DISABLE_TIMING, HIP_EVENT_INTERPROCESS = 0x2, 0x4


class FakeHip:
    """A ROCm engine: HIP's runtime API, as torch's ROCm build uses it for
    the same things (hipMalloc, hipIpcGetMemHandle, interprocess events
    on the engine's stream)."""

    def __init__(self, device=0, path=None):
        self.lib = ctypes.CDLL(path or os.environ["KVTIER_FAKE_HIP"])
        self.dev = device
        self.call("hipSetDevice", ctypes.c_int)(device)
        self.stream = ctypes.c_void_p()
        self.call("hipStreamCreate", ctypes.c_void_p)(ctypes.byref(self.stream))
        self.stream = self.stream.value

    def call(self, name, *argtypes):
        fn = getattr(self.lib, name)
        fn.argtypes, fn.restype = list(argtypes), ctypes.c_int

        def checked(*args):
            r = fn(*args)
            if r:
                raise CudaError("%s: hipError %d" % (name, r))
        return checked

    def uuid(self):
        """torch's str(props.uuid) on ROCm: hipDeviceGetUuid's bytes."""
        b = (ctypes.c_ubyte * 16)()
        self.call("hipDeviceGetUuid", ctypes.c_void_p, ctypes.c_int)(b, self.dev)
        h = bytes(b).hex()
        return "-".join((h[:8], h[8:12], h[12:16], h[16:20], h[20:]))

    def alloc(self, n):
        p = ctypes.c_void_p()
        self.call("hipMalloc", ctypes.c_void_p, ctypes.c_size_t)(ctypes.byref(p), n)
        return p.value

    def write(self, dev, data):
        self.call("hipMemcpy", ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t,
                  ctypes.c_int)(dev, data, len(data), HIP_MEMCPY_H2D)

    def read(self, dev, n):
        buf = ctypes.create_string_buffer(n)
        self.call("hipMemcpy", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                  ctypes.c_int)(buf, dev, n, HIP_MEMCPY_D2H)
        return buf.raw

    def mem_handle(self, dev):
        h = (ctypes.c_ubyte * 64)()
        self.call("hipIpcGetMemHandle", ctypes.c_void_p, ctypes.c_void_p)(h, dev)
        return bytes(h)

    def event(self):
        ev = ctypes.c_void_p()
        self.call("hipEventCreateWithFlags", ctypes.c_void_p, ctypes.c_uint)(
            ctypes.byref(ev), HIP_EVENT_INTERPROCESS | HIP_EVENT_DISABLE_TIMING)
        self.call("hipEventRecord", ctypes.c_void_p, ctypes.c_void_p)(ev, self.stream)
        h = (ctypes.c_ubyte * 64)()
        self.call("hipIpcGetEventHandle", ctypes.c_void_p, ctypes.c_void_p)(h, ev)
        return ev, bytes(h)

    def wait_ipc_event(self, handle):
        ev = ctypes.c_void_p()
        self.call("hipIpcOpenEventHandle", ctypes.c_void_p, IpcHandle)(
            ctypes.byref(ev), IpcHandle((ctypes.c_ubyte * 64)(*handle)))
        self.call("hipStreamWaitEvent", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)(
            self.stream, ev, 0)
        self.call("hipStreamSynchronize", ctypes.c_void_p)(self.stream)
        # the import outlives the wait (the fake HIP, as strict as the
        # strictest release, aborts otherwise)
        self.call("hipEventDestroy", ctypes.c_void_p)(ev)

    def kernel_write(self, dev, byte, n, delay_us):
        self.call("kvt_fake_hip_kernel_write", ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int,
                  ctypes.c_size_t, ctypes.c_uint)(self.stream, dev, byte, n, delay_us)
