"""A mixture of experts from its checkpoint, in bf16: a small Mixtral written by
`save_pretrained` (each expert stored apart), compiled for 2 stages, the stages built on the
device (their experts fused as they load) against the HuggingFace model loaded by
`from_pretrained`, one training step's loss and the first layer's expert gradients on the same
micro-batch. In bf16 the trace calls torch's grouped product (`aten._grouped_mm`) and counts
the routing with `histc` on floats: this is where both run on a GPU."""

from __future__ import annotations

from ..packages import compiled, hardware_for
from ..registry import Check, Findings, part

SHAPE = dict(vocab_size=1024, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
             num_experts_per_tok=2, max_position_embeddings=256)  # fmt: skip
SEQ, MICRO_BATCH = 64, 2
LOSS_RTOL = 2e-2  # bf16: the same kernels in another order
GRAD_RTOL = 5e-2  # the largest difference against the largest gradient
EXPERTS = "model.layers.0.mlp.experts.gate_up_proj"


@part("moe", "Mixture of experts from its checkpoint, bf16", cuda_s=60, cpu_s=45,
      needs=("compiler", "transformers"))  # fmt: skip
def moe(check: Check, found: Findings) -> None:
    import torch
    import transformers
    from ftpipe_runtime.data.batches import make_data
    from ftpipe_runtime.spec.topology import Topology
    from ftpipe_runtime.stage.package import build_stages

    folder = check.work / "mixtral"
    if not (folder / "config.json").exists():
        config = transformers.MixtralConfig(**SHAPE)
        config.architectures = ["MixtralForCausalLM"]
        torch.manual_seed(0)
        transformers.MixtralForCausalLM(config).save_pretrained(folder)
    args = ["-m", str(folder), "-g", "2", "-p", "even-layers", "--schedule", "1f1b",
            "--dtype", "bf16", "--seq-len", str(SEQ), "--micro-batch", str(MICRO_BATCH),
            "--batch", str(2 * MICRO_BATCH), "--hardware", hardware_for(check.device)]  # fmt: skip
    pkg = compiled(check, "moe", args)
    code = (pkg.folder / "stages.py").read_text()
    found["grouped_op"] = next(
        (op for op in ("aten._grouped_mm", "grouped_mm_fallback") if op in code), None
    )
    dev, dtype = torch.device(check.device), torch.bfloat16
    plan = pkg.one_rank()
    topo = Topology(plan)
    modules = build_stages(topo, pkg.stages, 0, dev, dtype)  # the experts fused as they load
    data = make_data(plan["model"], None, 0)
    batch = {n: data.get(n, 0).to(dev) for n in plan["model"]["inputs"]}
    values = dict(batch)
    for s in sorted(modules):
        values.update(
            modules[s](**{n: values[n] for n in (*topo.model_inputs[s], *topo.inputs[s])})
        )
    values["loss"].backward()
    mine = next(p.grad for m in modules.values() for n, p in m.named_parameters() if n == EXPERTS)

    model = transformers.MixtralForCausalLM.from_pretrained(folder, dtype=dtype).to(dev)
    model.config.use_cache = False
    loss = model(**batch).loss
    loss.backward()
    theirs = dict(model.named_parameters())[EXPERTS].grad

    found["loss"], found["hf_loss"] = values["loss"].item(), loss.item()
    found["loss_rel_diff"] = abs(found["loss"] - found["hf_loss"]) / abs(found["hf_loss"])
    scale = float(theirs.float().abs().max()) or 1.0
    found["experts_grad_rel_diff"] = float((mine.float() - theirs.float()).abs().max()) / scale
    found.expect(found["loss_rel_diff"] <= LOSS_RTOL,
                 f"the stages' loss is {found['loss_rel_diff']:.2e} from the model's")  # fmt: skip
    found.expect(found["experts_grad_rel_diff"] <= GRAD_RTOL,
                 f"the experts' gradients are {found['experts_grad_rel_diff']:.2e} from the "
                 "model's")  # fmt: skip
