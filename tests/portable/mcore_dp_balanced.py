"""Run Megatron-Core's own ``DpBalancedScheduler`` planning on JSON cases (stdin) and print its groups.

Executed in a subprocess with ``PYTHONPATH=$MCORE_SRC`` by ``test_schedule_matches_mcore.py``; each
case is ``{"lengths", "capacity_per_rank", "cp", "dp", "vpp_group", "max_seqs"}``. Also prints what the
generation table says of this tree's first bin (``dp_balanced_first_bin_donates``).
"""

import inspect
import json
import sys

from mcore_compat import detect

try:
    from megatron.core.datasets.data_schedule import BasePackingScheduler, DpBalancedScheduler
except ImportError:  # a tree from before the scheduler (releases, main before M3, dev before G2)
    print(json.dumps({"no_scheduler": detect().describe()}))
    sys.exit(0)

has_cap = "max_num_seqs" in inspect.signature(BasePackingScheduler.__init__).parameters
results = []
for case in json.load(sys.stdin):
    if case["max_seqs"] is not None and not has_cap:
        results.append({"skipped": "this tree has no max_num_seqs"})
        continue
    kwargs = {"max_num_seqs": case["max_seqs"]} if has_cap else {}
    scheduler = DpBalancedScheduler(case["capacity_per_rank"], case["cp"], case["dp"], case["vpp_group"], **kwargs)
    try:
        groups = scheduler.get_groups_and_subsamples([(i, n) for i, n in enumerate(case["lengths"])])
    except (AssertionError, IndexError) as exc:
        results.append({"error": f"{type(exc).__name__}: {exc}"})
        continue
    results.append({"groups": groups})
print(json.dumps({"first_bin_donates": detect().facts.dp_balanced_first_bin_donates, "results": results}))
