"""ggml backend buffers behind minigraph's Buffer: allocation, and moving bytes in and out.

A minigraph Buffer on a ggml device holds a `GgmlMemory`: the ggml buffer, its base address (on
the device: for an RPC server, an address in the server's process) and one byte-typed ggml
tensor spanning the whole buffer, through which ggml_backend_tensor_set/get move any byte range
(ggml moves bytes only through tensors). Freed with the Buffer."""
from __future__ import annotations

import weakref

GGML_TYPE_I8 = 24
# minigraph's buffer usage -> ggml's (enum ggml_backend_buffer_usage): ggml's scheduler places an op
# that reads a tensor of a WEIGHTS buffer on that buffer's device, as minigraph's does
USAGE = {"any": 0, "weights": 1, "compute": 2}


class GgmlMemory:
    def __init__(self, lib, handle, nbytes: int, usage: str = "any", alive=lambda: True):
        ffi = lib.ffi
        self.lib = lib
        size = max(int(nbytes), 1)
        self.buffer = lib.ggml_backend_alloc_buffer(handle, size)
        if self.buffer == ffi.NULL:
            raise MemoryError(f"{ffi.string(lib.ggml_backend_name(handle)).decode()}: could not allocate "
                              f"a buffer of {size} bytes")
        lib.ggml_backend_buffer_set_usage(self.buffer, USAGE[usage])
        self.base = lib.ggml_backend_buffer_get_base(self.buffer)
        self.address = int(ffi.cast("uintptr_t", self.base))
        self.ctx = lib.ggml_init({"mem_size": 2 * lib.ggml_tensor_overhead(), "mem_buffer": ffi.NULL,
                                  "no_alloc": True})
        ne = ffi.new("int64_t[1]", [size])
        self.whole = lib.ggml_new_tensor(self.ctx, GGML_TYPE_I8, 1, ne)
        status = lib.ggml_backend_tensor_alloc(self.buffer, self.whole, self.base)
        if status != 0:
            raise MemoryError(f"ggml_backend_tensor_alloc of a {size}-byte buffer failed (status {status})")
        weakref.finalize(self, _free, lib, self.buffer, self.ctx, alive)

    def get(self, offs: int, n: int):
        """n bytes from offs, as a bytearray."""
        out = bytearray(n)
        if n:
            self.lib.ggml_backend_tensor_get(self.whole, self.lib.ffi.from_buffer(out), offs, n)
        return out

    def set(self, offs: int, data) -> None:
        n = len(data)
        if n:
            self.lib.ggml_backend_tensor_set(self.whole, self.lib.ffi.from_buffer(data), offs, n)

    def clear(self, value: int) -> None:
        self.lib.ggml_backend_buffer_clear(self.buffer, value)


def _free(lib, buffer, ctx, alive):
    lib.ggml_free(ctx)
    if alive():       # freeing on a server that is gone would abort in ggml's RPC client: leave it
        lib.ggml_backend_buffer_free(buffer)
