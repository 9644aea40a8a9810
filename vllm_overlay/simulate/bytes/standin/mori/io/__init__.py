"""``mori.io`` as the MoRIIO connector imports it, over loopback (a stand-in;
see ``_loopback``)."""

from mori.io._loopback import (
    BackendType,
    EngineDesc,
    IOEngine,
    IOEngineConfig,
    IOEngineSession,
    LoopbackStats,
    MemoryDesc,
    MemoryLocationType,
    PollCqMode,
    RdmaBackendConfig,
    StatusCode,
    TransferStatus,
    XgmiBackendConfig,
)

STANDIN = True
"""Marks this package as the simulator's loopback stand-in, not mori."""

__all__ = [
    "STANDIN",
    "BackendType",
    "EngineDesc",
    "IOEngine",
    "IOEngineConfig",
    "IOEngineSession",
    "LoopbackStats",
    "MemoryDesc",
    "MemoryLocationType",
    "PollCqMode",
    "RdmaBackendConfig",
    "StatusCode",
    "TransferStatus",
    "XgmiBackendConfig",
]
