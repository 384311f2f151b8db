"""The worker's LoRA adapter caches, step by step against vLLM 0.33's own code.

vLLM's side (run with the oracle venv's Python, ../shared/tools/vllm_oracle): its
`LRUCacheWorkerLoRAManager.add_adapter` over an `LRUCacheLoRAModelManager` with its two
`AdapterLRUCache`s (max_cpu_loras adapters in host memory, max_loras GPU slots), built without a
model (no layers to copy into: the slots' bookkeeping is vLLM's all the same); reading an adapter
from disk (`_load_adapter`) is counted, not done. Each step calls `add_adapter` for the step's
adapters in ascending id order, as `_apply_adapters` does for its set (whose order is a hash's).
simkv's side: `simkv.backends.lora_adapters.AdapterResidency` on the same steps. Per step, the
disk reads and slot copies must be equal, and after it the order of both caches.

A development aid, not a test dependency:
    bash ../shared/tools/vllm_oracle/setup.sh /tmp/vllm-oracle-venv
    .venv/bin/python scripts/oracle_lora_worker.py --oracle-python /tmp/vllm-oracle-venv/bin/python --cases 200
(`--record tests/replay/data/lora_worker_vllm_cases.json --cases 40 --seed 7` made the test data.)
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def make_case(rng: random.Random) -> dict:
    max_loras = rng.randint(1, 4)
    max_cpu_loras = max_loras + rng.choice([0, 0, 1, 2, 5])
    num_adapters = rng.randint(1, max_cpu_loras + 4)
    popularity = [1.0 / (k + 1) ** rng.choice([0.0, 1.0, 2.0]) for k in range(num_adapters)]
    steps = []
    for _ in range(rng.randint(5, 60)):
        k = rng.randint(0, max_loras)
        chosen = set(rng.choices(range(1, num_adapters + 1), weights=popularity, k=k)) if k else set()
        steps.append(sorted(chosen)[:max_loras])
    return {"max_loras": max_loras, "max_cpu_loras": max_cpu_loras, "steps": steps}


def vllm_side(cases: list[dict]) -> list[list[dict]]:
    """Each case's steps through vLLM's worker manager: per step (disk reads, slot copies, host
    cache order, slot order)."""
    from types import SimpleNamespace

    from vllm.lora.model_manager import AdapterLRUCache, LRUCacheLoRAModelManager
    from vllm.lora.request import LoRARequest
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    out = []
    for case in cases:
        manager = object.__new__(LRUCacheLoRAModelManager)  # (no model: its slots' bookkeeping only)
        manager.lora_config = SimpleNamespace(max_cpu_loras=case["max_cpu_loras"], max_loras=case["max_loras"])
        manager.modules = {}
        manager._registered_adapters = AdapterLRUCache(manager.capacity, manager.deactivate_adapter)
        manager._active_adapters = AdapterLRUCache(manager.lora_slots, manager._deactivate_adapter)
        manager.lora_index_to_id = [None] * manager.lora_slots
        manager._validate_moe_lora_format = lambda lora: None
        manager._create_merged_loras_inplace = lambda lora: None
        manager._get_lora_layer_weights = lambda lora, name: None
        worker = object.__new__(LRUCacheWorkerLoRAManager)
        worker._adapter_manager = manager
        reads = [0]

        def load(request, reads=reads):
            reads[0] += 1
            return SimpleNamespace(id=request.lora_int_id)

        worker._load_adapter = load
        steps = []
        for adapters in case["steps"]:
            before_reads, before_slots = reads[0], list(manager.lora_index_to_id)
            copies = 0
            for adapter in adapters:
                active = adapter in manager._active_adapters
                worker.add_adapter(LoRARequest(f"lora-{adapter}", adapter, f"/adapters/{adapter}"))
                copies += not active
            assert before_slots is not manager.lora_index_to_id
            steps.append({"reads": reads[0] - before_reads, "copies": copies,
                          "cpu": list(manager._registered_adapters.order),
                          "gpu": list(manager._active_adapters.order)})
        out.append(steps)
    return out


def simkv_side(case: dict) -> list[dict]:
    sys.path.insert(0, str(ROOT))
    from tests.core.helpers import drive_lora_worker

    return drive_lora_worker(case)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--oracle-python", help="the vLLM oracle venv's python")
    parser.add_argument("--cases", type=int, default=200)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--record", metavar="JSON", help="write the cases with vLLM's steps (test data)")
    parser.add_argument("--vllm-side", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.vllm_side:
        json.dump(vllm_side(json.load(sys.stdin)), sys.stdout)
        return
    rng = random.Random(args.seed)
    cases = [make_case(rng) for _ in range(args.cases)]
    done = subprocess.run([args.oracle_python, __file__, "--vllm-side"], input=json.dumps(cases),
                          capture_output=True, text=True, check=False)
    if done.returncode:
        sys.exit(f"the vLLM side failed:\n{done.stderr[-3000:]}")
    theirs = json.loads(done.stdout)
    bad = 0
    reads = copies = 0
    for i, (case, vllm_steps) in enumerate(zip(cases, theirs)):
        ours = simkv_side(case)
        reads += sum(s["reads"] for s in vllm_steps)
        copies += sum(s["copies"] for s in vllm_steps)
        first = next((k for k, (a, b) in enumerate(zip(ours, vllm_steps)) if a != b), None)
        if first is not None:
            bad += 1
            print(f"case {i} ({case['max_loras']} slots, {case['max_cpu_loras']} in host memory): step {first} "
                  f"differs: simkv {ours[first]}, vLLM {vllm_steps[first]}")
    if args.record:
        Path(args.record).write_text(json.dumps({"source": "scripts/oracle_lora_worker.py, vLLM 0.33",
                                                 "seed": args.seed, "cases": [c | {"vllm": v} for c, v in
                                                                              zip(cases, theirs)]}) + "\n")
    print(f"{len(cases) - bad} of {len(cases)} cases equal ({sum(len(c['steps']) for c in cases):,} steps, "
          f"{reads:,} disk reads and {copies:,} slot copies in vLLM)")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
