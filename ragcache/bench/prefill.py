"""Our runner's prefill beside transformers' forward on the same tokens, interleaved in one run."""
from __future__ import annotations

import torch

from blend.model import load_model
from blend.runner import Runner

from .timing import interleaved, median, table


def run(settings, args) -> int:
    from transformers import AutoModelForCausalLM

    model = load_model(settings.model, settings.home, settings.device, settings.dtype)
    runner = Runner(model)
    hf = AutoModelForCausalLM.from_pretrained(model.path, local_files_only=True, dtype=model.dtype).to(model.device)
    hf.eval()
    ids = torch.randint(100, model.config.vocab_size, (args.tokens,), generator=torch.Generator().manual_seed(0))

    def ours():
        runner.prefill(ids)

    @torch.inference_mode()
    def theirs():
        hf(ids[None].to(model.device), use_cache=True)

    times = interleaved({"ragcache runner": ours, "transformers forward": theirs}, args.repeats)
    base = median(times["transformers forward"])
    rows = [[name, median(t), args.tokens / median(t), base / median(t)] for name, t in times.items()]
    print(f"model {model.name} {model.dtype} on {model.device}, {args.tokens} tokens, "
          f"median of {args.repeats} interleaved repeats, torch threads {torch.get_num_threads()}")
    print(table(rows, ["prefill", "seconds", "tokens/s", "speed vs transformers"]))
    return 0
