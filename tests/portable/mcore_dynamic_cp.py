"""Run Megatron-Core's own ``DefaultDynamicCPScheduler`` planning on JSON cases (stdin) and print its groups.

Executed in a subprocess with ``PYTHONPATH=$MCORE_SRC`` (a dev checkout) by ``test_dynamic_plan.py``;
each case is ``{"lengths", "capacity_per_rank", "cp", "dp", "min_size"}``.
"""

import json
import sys

from megatron.core.datasets.data_schedule import DefaultDynamicCPScheduler

results = []
for case in json.load(sys.stdin):
    scheduler = DefaultDynamicCPScheduler(
        case["capacity_per_rank"], case["cp"], case["dp"], None, min_cp_size=case["min_size"]
    )
    try:
        groups = scheduler.get_groups_and_subsamples([(i, n) for i, n in enumerate(case["lengths"])])
    except (AssertionError, IndexError) as exc:
        results.append({"error": f"{type(exc).__name__}: {exc}"})
        continue
    results.append({"groups": groups})
print(json.dumps(results))
