"""The planner on a decoder whose layers are stacked and scanned (``--scan_layers``): its FLOPs
are the whole update's (XLA's cost analysis counts a loop's body once), the commands take the
flag, and what stacked layers do not support is refused before anything compiles."""
import functools

import pytest

from redco.cli import main
from redco_planner.measure import measure
from redco_planner.models import zoo_llama
from redco_planner.planner import REMAT_POLICIES, effective_policies

SHAPE = dict(num_hidden_layers=3, hidden_size=32, intermediate_size=64, vocab_size=64,
             num_attention_heads=4, num_key_value_heads=2)


@functools.cache
def llama(scan: bool):
    return zoo_llama(16, scan, **SHAPE)


def step_flops(scan: bool, rows: int = 1, micro_batches: int = 1) -> float:
    model = llama(scan)
    flops = measure(model.params, model.loss_fn, model.batch(rows), 8, 1,
                    accumulate_grad_batches=micro_batches).flops
    print(f"scan={scan} rows={rows} micro_batches={micro_batches}: {flops:.4g} FLOPs")
    return flops


def test_a_scanned_steps_flops_count_every_layer_as_the_unrolled_steps_do():
    """XLA's count of the unrolled step (no loop in it) is the reference: the scanned step's
    counts its 3 layers (XLA's own count of it, its loop body once, reads 0.46x of it)."""
    unrolled, scanned = step_flops(False), step_flops(True)
    assert scanned == pytest.approx(unrolled, rel=0.06), (scanned, unrolled)


def test_an_accumulated_updates_flops_are_the_whole_updates():
    """Two micro-batches of 2 rows compute what one step on 4 rows computes: XLA's count of
    that step is the reference (the micro-batch loop counted once reads about half; the
    second micro-batch's elementwise work, 2.4% here at width 32, is not counted)."""
    accumulated, reference = step_flops(False, 2, 2), step_flops(False, 4)
    assert accumulated == pytest.approx(reference, rel=0.05), (accumulated, reference)


def test_a_scanned_lora_steps_flops_and_state_are_the_unrolled_ones():
    """LoRA rank 4 on the stacked projections (``--scan_layers --lora_rank``): the compiled
    step's params' and optimizer state's bytes per device are the unrolled step's, its FLOPs
    within 15% (the scan's uniform body also forms layer 0's input gradient, which the
    unrolled step skips under a frozen embedding: +2.6% by the jaxpr's count; XLA's count of
    the scanned step, its body once plus the repeats, reads 13% under the unrolled one's)."""
    from redco.lora import trainable_mask
    got = {}
    for scan in (False, True):
        lora = llama(scan).lora(4)
        got[scan] = measure(lora.params, lora.loss, llama(scan).batch(1), 8, 2,
                            trainable=trainable_mask(lora.params))
    assert got[True].flops == pytest.approx(got[False].flops, rel=0.15)
    assert got[True].state_bytes == got[False].state_bytes
    assert got[True].params_bytes == got[False].params_bytes


def test_a_scanned_stack_is_planned_without_dots_saveable():
    """In a scanned body ``"none"`` keeps what ``dots_with_no_batch_dims_saveable`` keeps
    (``redco.remat.scanned_body``); ``dots_saveable`` keeps more there (llama-tiny, 64 tokens x
    4 rows, mp=1 on 8 devices: 13.7 MiB against 13.0), so the remat ladder skips it. Unrolled
    it keeps less (11.3 MiB against 13.4) and is tried; asked for alone, it is kept."""
    def policies(scan: bool, asked=REMAT_POLICIES) -> list[str]:
        model = llama(scan)
        return effective_policies(asked, model.loss_fn, model.params, model.batch(1))
    assert policies(True) == ["none", "full"]
    assert policies(False) == ["none", "dots_saveable", "full"]
    assert policies(True, ("dots_saveable",)) == ["dots_saveable"]


def test_redco_rules_prints_the_stacks_split_behind_the_layer_axis(capsys):
    main(["rules", "llama-tiny", "--devices", "8", "--n_model_shards", "2", "--scan_layers"])
    lines = capsys.readouterr().out.splitlines()
    q = next(line for line in lines if line.startswith("model/layers/0:2/self_attn/q_proj"))
    assert q.split()[1] == "2x128x128" and "(None, None, 'mp')" in q


def test_redco_plan_refuses_to_stack_a_model_that_is_not_the_zoos(capsys):
    argv = ["plan", "--model", "planner_helpers:one_head_plan_model", "--devices", "8",
            "--device_memory", "1GB", "--scan_layers"]
    with pytest.raises(SystemExit):
        main(argv)
    err = capsys.readouterr()
    assert "only the zoo's decoders" in err.err and "compiled in" not in err.out, err


def test_redco_plan_scans_by_default_and_splits_the_sequence_of_a_scanned_model(capsys):
    """Without ``--scan_layers`` the zoo decoder is planned stacked (its default), and a context-
    parallel layout compiles with the scan's body inside each layer's sequence split."""
    main(["plan", "--model", "llama-tiny", "--devices", "8", "--device_memory", "1GB",
          "--n_context_shards", "2"])
    out = capsys.readouterr().out
    assert "llama-tiny (layers stacked and scanned)" in out, out
    assert "n_context_shards=2" in out and "cp=2" in out, out
