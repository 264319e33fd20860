"""Probe the CUDA driver's stream memory operations the copy-engine transport orders its transfers with, on one GPU:

    python tools/probe_stream_flags.py [--timeout 30] [--only TEXT]

A flag waited for on one stream (``cuStreamWaitValue``) and written on another (``cuStreamWriteValue``), the
pattern of ``longattn.distributed.copy_engine`` (a rank queues its waits on one side stream, its writes on another),
in variants that tell the candidate causes of a wait that never sees its write apart. Each variant runs in a child
process with a time limit (a stream waiting on a flag that is never written waits forever) and prints ``ok``,
``HANG`` or the error. First the facts that matter: driver and bindings versions, the device's stream memory
operation attributes, ``CUDA_DEVICE_MAX_CONNECTIONS``.
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

_CHILD = r'''
import sys, torch
from longattn.distributed import cuda_driver
variant = sys.argv[1]
d = cuda_driver.load()
cu = d.cu
torch.zeros(1, device="cuda")
bits = 32 if "32-bit" in variant else 64
value = 7 if bits == 32 else 2 ** 40 + 3
if "cuMemAlloc" in variant:
    err, ptr = cu.cuMemAlloc(8)
    d.check("cuMemAlloc", err)
    d.check("cuMemsetD8", cu.cuMemsetD8(ptr, 0, 8))
    address = int(ptr)
else:
    flag = torch.zeros(1, dtype=torch.int64, device="cuda")
    address = flag.data_ptr()
if "driver streams" in variant:
    def new_stream():
        err, s = cu.cuStreamCreate(cu.CUstream_flags.CU_STREAM_NON_BLOCKING.value)
        d.check("cuStreamCreate", err)
        return int(s)
    producer, consumer = new_stream(), new_stream()
else:
    ps, cs = torch.cuda.Stream(), torch.cuda.Stream()
    producer, consumer = ps.cuda_stream, cs.cuda_stream
    if "same stream" in variant:
        consumer = producer
torch.cuda.synchronize()
op = cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_EQ if "EQ" in variant else \
    cu.CUstreamWaitValue_flags.CU_STREAM_WAIT_VALUE_GEQ
write_flag = cu.CUstreamWriteValue_flags.CU_STREAM_WRITE_VALUE_DEFAULT
wait = (lambda: d.check("wait", cu.cuStreamWaitValue32(consumer, address, value, op))) if bits == 32 else \
    (lambda: d.check("wait", cu.cuStreamWaitValue64(consumer, address, value, op)))
if "host write" in variant:
    write = lambda: d.check("cuMemcpyHtoD", cu.cuMemcpyHtoD(address, value.to_bytes(8, "little"), 8))
elif bits == 32:
    write = lambda: d.check("write", cu.cuStreamWriteValue32(producer, address, value, write_flag))
else:
    write = lambda: d.check("write", cu.cuStreamWriteValue64(producer, address, value, write_flag))
x = torch.zeros(1 << 20, device="cuda")
y = None
p_stream, c_stream = torch.cuda.ExternalStream(producer), torch.cuda.ExternalStream(consumer)
if "kernels loaded first" in variant:  # each kernel launched once before any wait is queued
    torch.cuda._sleep(1000)
    x.fill_(0.0)
    x.sum()
torch.cuda.synchronize()
plain_wait, plain_write = wait, write


def wait():
    global y
    plain_wait()
    if "kernel after wait" in variant:  # work the wait must hold back
        with torch.cuda.stream(c_stream):
            y = x.sum()


def write():
    if "sleep before write" in variant:  # the producer busy when the wait is reached
        with torch.cuda.stream(p_stream):
            torch.cuda._sleep(50_000_000)
            x.fill_(1.0)
    plain_write()


if "write first" in variant:
    write(); wait()
else:
    wait(); write()
d.check("cuStreamSynchronize", cu.cuStreamSynchronize(consumer))
if y is not None and "sleep before write" in variant and int(y.item()) != x.numel():
    raise SystemExit(f"the kernel after the wait ran before the write: sum {y.item()} != {x.numel()}")
print("ok")
'''

VARIANTS = (
    "torch streams, wait queued first (the transport's order)",
    "torch streams, write first",
    "same stream, write first",
    "torch streams, wait queued first, 32-bit",
    "torch streams, wait queued first, EQ",
    "torch streams, wait queued first, cuMemAlloc flag",
    "driver streams, wait queued first",
    "torch streams, wait queued first, host write",
    "torch streams, wait queued first, CUDA_DEVICE_MAX_CONNECTIONS=32",
    "torch streams, wait queued first, sleep before write",
    "torch streams, wait queued first, kernel after wait",
    "torch streams, wait queued first, sleep before write, kernel after wait (the GPU test's program)",
    "driver streams, wait queued first, sleep before write, kernel after wait",
    "torch streams, wait queued first, sleep before write, kernel after wait, CUDA_DEVICE_MAX_CONNECTIONS=32",
    "torch streams, wait queued first, sleep before write, kernel after wait, CUDA_DEVICE_MAX_CONNECTIONS=1",
    "torch streams, wait queued first, sleep before write, kernel after wait, kernels loaded first",
    "torch streams, wait queued first, sleep before write, kernel after wait, CUDA_MODULE_LOADING=EAGER",
    "torch streams, wait queued first, kernel after wait, kernels loaded first",
)


def facts() -> str:
    import torch

    from longattn.distributed import cuda_driver
    d = cuda_driver.load()
    cu = d.cu
    torch.zeros(1, device="cuda")
    attrs = []
    for name in ("CU_DEVICE_ATTRIBUTE_CAN_USE_64_BIT_STREAM_MEM_OPS",
                 "CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_WAIT_VALUE_NOR",
                 "CU_DEVICE_ATTRIBUTE_CAN_USE_STREAM_MEM_OPS_V1"):
        attr = getattr(cu.CUdevice_attribute, name, None)
        if attr is not None:
            err, value = cu.cuDeviceGetAttribute(attr, torch.cuda.current_device())
            attrs.append(f"{name.replace('CU_DEVICE_ATTRIBUTE_', '')}={value if err == 0 else err}")
    err, version = cu.cuDriverGetVersion()
    try:
        from importlib.metadata import version as pkg_version
        bindings = pkg_version("cuda-python")
    except Exception:  # noqa: BLE001 (not installed as a distribution)
        bindings = "?"
    return (f"{torch.cuda.get_device_name()}, driver {version}, cuda-python {bindings}, torch {torch.__version__}, "
            f"CUDA_DEVICE_MAX_CONNECTIONS={os.environ.get('CUDA_DEVICE_MAX_CONNECTIONS', 'unset')}; "
            + ", ".join(attrs))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--timeout", type=float, default=30.0, help="seconds a variant may take")
    p.add_argument("--only", default="", help="run only the variants whose name contains this text")
    a = p.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    sys.path.insert(0, root)
    print(facts(), flush=True)
    for variant in (v for v in VARIANTS if a.only in v):
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(x for x in (root, os.environ.get("PYTHONPATH")) if x))
        for name in ("CUDA_DEVICE_MAX_CONNECTIONS", "CUDA_MODULE_LOADING"):
            if f"{name}=" in variant:
                env[name] = variant.split(f"{name}=")[1].split(",")[0]
        try:
            done = subprocess.run([sys.executable, "-c", _CHILD, variant], capture_output=True, text=True,
                                  timeout=a.timeout, env=env)
            result = "ok" if done.returncode == 0 and "ok" in done.stdout else \
                f"ERROR {(done.stderr.strip().splitlines() or ['?'])[-1][:200]}"
        except subprocess.TimeoutExpired:
            result = f"HANG (no end in {a.timeout:g} s)"
        print(f"{variant}: {result}", flush=True)


if __name__ == "__main__":
    main()
