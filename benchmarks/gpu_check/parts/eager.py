"""The generated stages against HuggingFace eager: one bf16 training step's forward and
backward (the optimizer step is the same code either way) of the Llama-shaped model, on the
same micro-batch, with the same weights' shapes and dtype; the time ratio (the aim: within
1.05x). Both run as plain modules, the stages one after the other, without the runtime."""

from __future__ import annotations

from ..registry import Check, Findings, part
from ..timing import timed_in_turn
from .llama import llama_package

AIM = 1.05  # generated / HF eager, one GPU, bf16 (issue 31)


@part("eager", "Generated stages vs HuggingFace eager, one bf16 step", cuda_s=60, cpu_s=45,
      needs=("compiler", "transformers"))  # fmt: skip
def eager(check: Check, found: Findings) -> None:
    import torch
    from ftpipe_runtime.data.batches import make_data
    from ftpipe_runtime.models.hf import build_model
    from ftpipe_runtime.spec.topology import Topology
    from ftpipe_runtime.stage.package import build_stages
    from ftpipe_runtime.train.precision import get_precision

    # the package's compute dtype (bf16 in both sizes; fp32 where a CPU run compares speed)
    dev = torch.device(check.device)
    dtype = getattr(torch, get_precision(check.sizes.llama_dtype).compute)
    pkg = llama_package(check)
    plan = pkg.one_rank()
    topo = Topology(plan)
    modules = build_stages(topo, pkg.stages, 0, dev, dtype)
    data = make_data(plan["model"], None, 0)
    names = list(plan["model"]["inputs"])
    batch = {n: data.get(n, 0).to(dev) for n in names}

    def generated():
        for mod in modules.values():
            mod.zero_grad(set_to_none=True)
        values = dict(batch)
        for s in sorted(modules):
            wanted = {n: values[n] for n in (*topo.model_inputs[s], *topo.inputs[s])}
            values.update(modules[s](**wanted))
        values["loss"].backward()
        return values["loss"]

    model = build_model(plan["model"]["config"], plan["model"]["hf_class"], device=dev,
                        dropout=0.0, dtype=dtype)  # fmt: skip
    model.config.use_cache = False

    def hf():
        model.zero_grad(set_to_none=True)
        loss = model(**batch).loss
        loss.backward()
        return loss

    found["inputs"] = {n: list(t.shape) for n, t in batch.items()}
    found["padding"] = bool((batch["attention_mask"] == 0).any()) if "attention_mask" in batch \
        else False  # fmt: skip
    found["attn_implementation"] = getattr(model.config, "_attn_implementation", None)
    repeats = check.sizes.eager_repeats
    seconds = timed_in_turn(check.device, {"generated": generated, "hf": hf},
                            repeats=repeats, warmup=2)  # fmt: skip
    found["generated_s"], found["hf_eager_s"] = seconds["generated"], seconds["hf"]
    found["ratio"] = found["generated_s"] / found["hf_eager_s"]
    if check.device == "cuda":
        found.expect(found["ratio"] <= AIM, f"the generated stages take {found['ratio']:.3f}x "
                     f"HF eager's time (aim: {AIM}x)")  # fmt: skip
