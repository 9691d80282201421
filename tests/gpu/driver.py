"""Run several pretrain_rl.py command lines in one process, one after the other (saves start-up time).

    python -m tests.gpu.driver RUNS.json RESULTS.json

RUNS.json maps a name to pretrain_rl.py arguments. Each run is `pretrain_rl.main(args)` (it sets up
and tears down torch.distributed itself) on a fresh MASTER_PORT; RESULTS.json maps each name to
null, or to the traceback / exit code text of a run that failed. A failed run does not stop the
others. The dense test reward of tests/golden.py is registered first, so runs may use it.
"""
from __future__ import annotations

import json
import os
import sys
import traceback


def main(argv: list[str]) -> int:
    spec_file, result_file = argv
    with open(spec_file) as f:
        runs = json.load(f)
    import pretrain_rl
    from tests.golden import register_reward
    from tests.spawn import free_port

    register_reward()   # runs may name the dense test reward (tests.gpu.runs.DENSE_REWARD)

    os.environ.update(MASTER_ADDR="127.0.0.1", RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    results = {}
    for name, args in runs.items():
        os.environ["MASTER_PORT"] = str(free_port())
        try:
            rc = pretrain_rl.main(args)
            results[name] = None if rc == 0 else f"pretrain_rl.main returned {rc}"
        except BaseException:  # noqa: BLE001 - recorded for the test to report
            results[name] = traceback.format_exc()
            from megatron_rl.parallel import destroy_parallel

            try:  # best effort before the next run
                destroy_parallel()
            except Exception as e:  # noqa: BLE001
                print(f"driver: {name}: teardown failed too: {type(e).__name__}: {e}", flush=True)
        print(f"driver: {name}: {'ok' if results[name] is None else 'FAILED'}", flush=True)
    with open(result_file, "w") as f:
        json.dump(results, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
