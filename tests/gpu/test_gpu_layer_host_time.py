"""The layer host-time row (``megatron_ring_lab.bench.layer_host_time``) on each device: the Megatron layer's
forward+backward and the bare ``ring_attention`` call both timed, the glue's share their difference, and the
layer's outputs and gradients the same bytes from one call to the next (the hash ``bench_revisions`` compares).
The ``cuda`` variant (bf16, wall clock from launch to return) where a GPU is; the ``cpu`` one everywhere."""
import pytest


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_layer_host_time_row_on_the_device(device):
    from megatron_ring_lab.bench.layer_host_time import layer_host_times

    rows = [layer_host_times(heads=4, kv_heads=2, head_dim=64 if device == "cuda" else 8, iters=20, warmup=3,
                             device=device) for _ in range(2)]
    for r in rows:
        assert r["device"] == device and r["layer_s"] > 0 and r["ring_s"] > 0
        assert r["glue_s"] == pytest.approx(r["layer_s"] - r["ring_s"])
    assert rows[0]["outputs_sha256"] == rows[1]["outputs_sha256"]
