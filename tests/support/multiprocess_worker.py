"""One process of a multi-process training test: runs `focus-hf train ARGS` (`cli`) or a training script
(`script PATH ARGS`), then writes the routers this process ended with to `$FOCUS_TEST_DUMP/rank<RANK>.safetensors`.

Launched as `python -m torch.distributed.run --nproc_per_node 2 tests/support/multiprocess_worker.py ...` (or plainly,
for the one-process reference) by tests/fitting/test_multiprocess.py.
"""

from __future__ import annotations

import os
import runpy
import sys

from safetensors.torch import save_file


def dump(model) -> None:
    rank = int(os.environ.get("RANK", "0"))
    routers = {name: p.detach().cpu().contiguous() for name, p in model.named_parameters() if "focus_" in name}
    save_file(routers, os.path.join(os.environ["FOCUS_TEST_DUMP"], f"rank{rank}.safetensors"))


def dumping(train):
    def train_and_dump(model, *args, **kwargs):
        result = train(model, *args, **kwargs)
        dump(model)
        return result

    return train_and_dump


def main() -> int:
    kind, *rest = sys.argv[1:]
    if kind == "cli":
        import focus_hf.fitting.distill as distill
        import focus_hf.fitting.layerwise as layerwise
        import focus_hf.fitting.trainer as training
        from focus_hf.cli import main as cli_main

        # The training functions `focus-hf train` calls (it imports them when it runs), wrapped to dump the routers.
        for module, name in (
            (training, "train_adapter"),
            (distill, "distill_routers"),
            (layerwise, "distill_routers_layerwise"),
        ):
            setattr(module, name, dumping(getattr(module, name)))
        return cli_main(rest)
    from transformers import Trainer

    original_train = Trainer.train

    def train(self, *args, **kwargs):
        result = original_train(self, *args, **kwargs)
        dump(self.model)
        return result

    Trainer.train = train
    script, *script_args = rest
    sys.argv = [script, *script_args]
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
