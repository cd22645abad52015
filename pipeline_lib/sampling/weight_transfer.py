"""vLLM's native weight-transfer API (NCCL backend) from a trainer that does not import vLLM: the policy's
tensors go GPU to GPU by NCCL broadcast, the control plane over the server's HTTP routes
(/init_weight_transfer_engine, /start_weight_update, /update_weights, /finish_weight_update)."""

from __future__ import annotations

import base64
import ctypes
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch import nn

from pipeline_lib.errors import AlignflowError
from pipeline_lib.workspace import LOOPBACK_INTERFACES

NCCL_LIB_ENV = "ALIGNFLOW_NCCL_LIB"
UNIQUE_ID_BYTES = 128
# ncclDataType_t and ncclRedOp_t values of nccl.h
NCCL_DTYPES = {torch.int8: 0, torch.uint8: 1, torch.int32: 2, torch.int64: 4, torch.float16: 6,
               torch.float32: 7, torch.float64: 8, torch.bfloat16: 9}
NCCL_SUM = 0


class WeightTransferError(AlignflowError, RuntimeError):
    """NCCL could not be loaded or a collective failed."""


class _UniqueId(ctypes.Structure):
    _fields_ = [("internal", ctypes.c_byte * UNIQUE_ID_BYTES)]


def nccl_library_path() -> str:
    """$ALIGNFLOW_NCCL_LIB, else the libnccl of the `nvidia-nccl` wheel CUDA torch depends on, else the soname."""
    chosen = os.environ.get(NCCL_LIB_ENV)
    if chosen:
        return chosen
    try:
        import nvidia.nccl  # the CUDA torch wheels' dependency

        for root in nvidia.nccl.__path__:
            found = sorted(Path(root, "lib").glob("libnccl.so*"))
            if found:
                return str(found[0])
    except ImportError:
        pass
    return "libnccl.so.2"


def load_nccl() -> ctypes.CDLL:
    path = nccl_library_path()
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        raise WeightTransferError(f"NCCL weight transfer: cannot load {path} ({exc}); install a CUDA torch build "
                                  f"or set ${NCCL_LIB_ENV}") from None
    lib.ncclGetErrorString.restype = ctypes.c_char_p
    return lib


class NcclComm:
    """One rank of an NCCL communicator joined from a shared unique id (ctypes over libnccl, trainer side)."""

    def __init__(self, lib: ctypes.CDLL, unique_id: bytes, *, rank: int, world_size: int, device: torch.device):
        self.lib, self.device = lib, device
        uid = _UniqueId()
        ctypes.memmove(ctypes.byref(uid), unique_id, UNIQUE_ID_BYTES)
        self.comm = ctypes.c_void_p()
        with torch.cuda.device(device):
            self._check(lib.ncclCommInitRank(ctypes.byref(self.comm), world_size, uid, rank), "ncclCommInitRank")

    @staticmethod
    def new_unique_id(lib: ctypes.CDLL) -> bytes:
        uid = _UniqueId()
        code = lib.ncclGetUniqueId(ctypes.byref(uid))
        if code != 0:
            raise WeightTransferError(f"ncclGetUniqueId failed: {lib.ncclGetErrorString(code).decode()}")
        return bytes(uid.internal)

    def _check(self, code: int, call: str) -> None:
        if code != 0:
            raise WeightTransferError(f"{call} failed: {self.lib.ncclGetErrorString(code).decode()}")

    def _stream(self) -> ctypes.c_void_p:
        return ctypes.c_void_p(torch.cuda.current_stream(self.device).cuda_stream)

    def all_reduce_(self, tensor: torch.Tensor) -> None:
        ptr = ctypes.c_void_p(tensor.data_ptr())
        self._check(self.lib.ncclAllReduce(ptr, ptr, ctypes.c_size_t(tensor.numel()), NCCL_DTYPES[tensor.dtype],
                                           NCCL_SUM, self.comm, self._stream()), "ncclAllReduce")

    def broadcast_(self, tensor: torch.Tensor, root: int = 0) -> None:
        ptr = ctypes.c_void_p(tensor.data_ptr())
        self._check(self.lib.ncclBroadcast(ptr, ptr, ctypes.c_size_t(tensor.numel()), NCCL_DTYPES[tensor.dtype],
                                           root, self.comm, self._stream()), "ncclBroadcast")

    def close(self) -> None:
        if self.comm:
            self.lib.ncclCommDestroy(self.comm)
            self.comm = ctypes.c_void_p()


def server_gpu(policy_device: torch.device) -> str | None:
    """The CUDA_VISIBLE_DEVICES entry for a vLLM server beside a policy on `policy_device`: the last visible
    GPU other than the policy's. None when the policy is not on CUDA or no second GPU is visible (NCCL cannot
    pair two processes on one device)."""
    if policy_device.type != "cuda" or torch.cuda.device_count() < 2:
        return None
    own = policy_device.index if policy_device.index is not None else torch.cuda.current_device()
    other = max(i for i in range(torch.cuda.device_count()) if i != own)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[other].strip() if visible else str(other)


def update_info(model: nn.Module) -> dict[str, list]:
    """The /update_weights payload: checkpoint names, torch dtype names and shapes, in broadcast order."""
    params = list(model.state_dict().items())
    return {"names": [name for name, _ in params],
            "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in params],
            "shapes": [list(t.shape) for _, t in params]}


class NcclWeightTransfer:
    """Pushes a policy's weights into a vLLM server started with `--weight-transfer-config {"backend":"nccl"}`
    on other GPUs: the trainer is rank 0, the server's `server_ranks` workers ranks 1..n.

    `post(path, json)` is the server's control plane (VLLMSampler.post). Each HTTP call that makes the
    workers join a collective runs in a thread while this process joins the same collective."""

    def __init__(self, post: Callable[[str, dict | None], object], *, device: torch.device, server_ranks: int = 1):
        self.post, self.device = post, device
        for name, interface in LOOPBACK_INTERFACES.items():  # the unique id's bootstrap socket, not the network's
            os.environ.setdefault(name, interface)
        self.lib = load_nccl()
        unique_id = NcclComm.new_unique_id(self.lib)
        init = {"nccl_unique_id_b64": base64.b64encode(unique_id).decode(), "rank_offset": 1,
                "world_size": server_ranks + 1}
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(self.post, "/init_weight_transfer_engine", {"init_info": init})
            self.comm = NcclComm(self.lib, unique_id, rank=0, world_size=server_ranks + 1, device=device)
            # vLLM's workers warm their communicator up with a one-element all-reduce; every peer must match it
            self.comm.all_reduce_(torch.zeros(1, device=device))
            torch.cuda.synchronize(device)
            answer.result()

    @torch.no_grad()
    def push(self, model: nn.Module) -> None:
        """start -> (update_weights over HTTP while broadcasting every tensor from rank 0) -> finish."""
        self.post("/start_weight_update", None)
        with ThreadPoolExecutor(1) as pool:
            answer = pool.submit(self.post, "/update_weights", {"update_info": update_info(model)})
            for tensor in model.state_dict().values():
                self.comm.broadcast_(tensor.detach().to(self.device).contiguous())
            torch.cuda.synchronize(self.device)
            answer.result()
        self.post("/finish_weight_update", None)

    def close(self) -> None:
        try:
            self.post("/shutdown_weight_transfer_engine", None)
        finally:
            self.comm.close()
