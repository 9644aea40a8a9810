"""A closed rank leaves its process as the zygote forked it, so the process
can build the next configuration's rank: vLLM's parallel state, the current
config, torch's CUDA names (a WRITE rank's shim) and the stand-in engine's
threads are all gone or restored. The KV buffer's file stays for the next
rank in its slot, which starts from its own canary byte: nothing of the
earlier configuration's bytes is left in it."""

from __future__ import annotations

import json
import os

from tests.child import run_python
from vllm_overlay.simulate.bytes.run import STANDIN_DIR

_SCRIPT = r"""
import json, os, sys, threading
from vllm_overlay import cpuplatform
cpuplatform.use_in_this_process()
import numpy as np
import torch
import vllm.distributed.parallel_state as ps
from vllm.config import get_current_vllm_config_or_none
from vllm_overlay.simulate.bytes.driver import free_port_block
from vllm_overlay.simulate.bytes.rank import Rank
from vllm_overlay.simulate.bytes.steps import RankConfig
from vllm_overlay.simulate.bytes.shm import remove_shm, shm_path

event, stream = torch.cuda.Event, torch.cuda.current_stream


def state():
    return {
        "dist": torch.distributed.is_initialized(),
        "tp": ps._TP is not None,
        "world": ps._WORLD is not None,
        "config": get_current_vllm_config_or_none() is not None,
        "cuda": torch.cuda.Event is event and torch.cuda.current_stream is stream,
        "standin_threads": sorted(
            t.name for t in threading.enumerate() if t.name.startswith("mori-standin")
        ),
        "file": os.stat(SLOT).st_ino if os.path.exists(SLOT) else None,
    }


SLOT = shm_path(os.getpid(), "p0")


out = []
for mode, layout in (("write", "llama"), ("read", "kimi"), ("read", "llama")):
    base = free_port_block()
    rank = Rank(RankConfig(
        layout=layout, mode=mode, role="kv_producer", tp_size=1, tp_rank=0,
        kv_layout="LBNHC", handshake_port=base, notify_port=base + 10,
        dist_port=base + 20, max_model_len=128, open_port=base + 30,
        kv_file=SLOT,
    ))
    rank.open()
    rank.stats()
    opened = state()
    opened["bytes"] = np.unique(rank.kv.bytes).tolist()
    # What a configuration leaves in its buffer.
    rank.kv.bytes[::4096] = 0x77
    rank.close()
    out.append([opened, state()])
remove_shm(os.getpid())
out.append(os.path.exists(SLOT))
print(json.dumps(out))
"""


def test_a_closed_rank_leaves_its_process_ready_for_the_next() -> None:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(STANDIN_DIR), *filter(None, [env.get("PYTHONPATH")])]
    )
    env["VLLM_SSM_CONV_STATE_LAYOUT"] = "DS"
    done = run_python(_SCRIPT, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    *runs, file_left = json.loads(done.stdout.strip().splitlines()[-1])
    assert len(runs) == 3
    inode = runs[0][0]["file"]
    for (opened, closed), shimmed in zip(runs, (True, False, False), strict=True):
        assert opened["dist"] and opened["tp"] and opened["world"]
        assert opened["config"] and opened["file"] == inode is not None
        assert opened["cuda"] is not shimmed
        assert opened["standin_threads"]
        # The prefill leg's canary, everywhere: the last rank's bytes are gone.
        assert opened["bytes"] == [0x3C]
        assert closed == {
            "dist": False,
            "tp": False,
            "world": False,
            "config": False,
            "cuda": True,
            "standin_threads": [],
            "file": inode,
        }
    assert not file_left, "the owner's files were not removed"
