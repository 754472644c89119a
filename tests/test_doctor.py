"""Doctor on CPU: the real checks pass, and broken kernels (simulated by monkeypatching) are caught."""

from __future__ import annotations

import pytest
import torch

from rlanywhere import doctor
from rlanywhere import machine, plans
from rlanywhere.config import load_config
from rlanywhere.plans import RolloutPlan

CHECK_NAMES = {"probe", "torch kernels for the GPU", "plan", "matmul fp32", "matmul compute dtype", "attention",
               "tiny model fwd+bwd", "generation", "fp16", "memory cap"}


def _quiet(_text: str) -> None:
    pass


@pytest.fixture(autouse=True)
def _kernel_probes_cached_again_afterwards(monkeypatch):
    """run_doctor tells the whole process to run every kernel probe again (right for the doctor's own process);
    the tests that run after these in the same worker expect the cached probes."""
    monkeypatch.setattr(machine, "_fresh_probes", machine._fresh_probes)


def test_doctor_passes_on_cpu(capsys):
    ok, report = doctor.run_doctor(None)
    assert ok
    assert {entry["name"] for entry in report} == CHECK_NAMES
    assert all(entry["status"] in ("pass", "skip") for entry in report)
    assert all(entry["seconds"] >= 0 and entry["detail"] for entry in report)
    out = capsys.readouterr().out
    assert "decision" in out and "all checks passed" in out  # plan table and pass/fail table printed


def test_doctor_catches_a_wrong_matmul(monkeypatch):
    real = doctor._planned_matmul
    monkeypatch.setattr(doctor, "_planned_matmul", lambda a, b, plan, use_autocast: real(a, b, plan, use_autocast)
                        * 1.001)  # 1e-3 relative error: far beyond fp32's limit
    ok, report = doctor.run_doctor(None, print_fn=_quiet)
    assert not ok
    entry = next(e for e in report if e["name"] == "matmul fp32")
    assert entry["status"] == "fail" and "1.00e-03" in entry["detail"]


def test_doctor_catches_wrong_attention_masking(monkeypatch):
    # An attention kernel that ignores the padding mask (but stays causal) must fail the comparison.
    def unmasked(q, k, v, mask, plan):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    monkeypatch.setattr(doctor, "_planned_attention", unmasked)
    status, detail = doctor.check_attention(plans.Plan(), torch.device("cpu"))
    assert status == "fail", detail


def test_a_crashing_check_is_reported_not_raised(monkeypatch):
    def boom(plan, device):
        raise RuntimeError("CUDA error: no kernel image is available for execution on the device")

    monkeypatch.setattr(doctor, "check_generation", boom)
    ok, report = doctor.run_doctor(None, print_fn=_quiet)
    entry = next(e for e in report if e["name"] == "generation")
    assert not ok and entry["status"] == "fail" and "no kernel image" in entry["detail"]


def test_impossible_plan_fails_the_doctor():
    ok, report = doctor.run_doctor(load_config(None, ["hardware.precision=fp16"]),
                                   machine=machine.HardwareProbe.fake(None), print_fn=_quiet)
    assert not ok
    assert [e["status"] for e in report if e["name"] == "plan"] == ["fail"]


def test_bf16_eager_path_checks_pass_on_cpu():
    plan = plans.Plan(precision="bf16", compute_dtype=torch.bfloat16, rollout=RolloutPlan(dtype=torch.bfloat16), use_autocast=True,
                   attn_implementation="eager", gradient_checkpointing=True)
    cpu = torch.device("cpu")
    for check in (doctor.check_matmul_compute, doctor.check_attention, doctor.check_tiny_model):
        status, detail = check(plan, cpu)
        assert status == "pass", (check.__name__, detail)
    assert doctor.check_memory_cap(plan, cpu)[0] == "skip"


def test_doctor_main_exit_codes():
    assert doctor.doctor_main(None, ["hardware.device=cpu"]) == 0
    assert doctor.doctor_main(None, ["hardware.precision=fp16", "hardware.device=cpu"]) == 1


def test_fp16_mixed_precision_path_checks_pass_on_cpu():
    """The fp16 plan of a T4/V100 (fp16 autocast, fp32 master weights, GradScaler), run on CPU autocast."""
    plan = plans.Plan(precision="fp16", compute_dtype=torch.float16, rollout=RolloutPlan(dtype=torch.float16), use_autocast=True,
                   use_grad_scaler=True)
    cpu = torch.device("cpu")
    for check in (doctor.check_matmul_compute, doctor.check_attention, doctor.check_tiny_model, doctor.check_fp16):
        status, detail = check(plan, cpu)
        assert status == "pass", (check.__name__, detail)
    assert doctor.check_fp16(plans.Plan(), cpu)[0] == "skip"
def test_torch_kernels_check_names_the_cu126_build_for_a_p40(monkeypatch):
    """A default (cc >= 7.5) torch build on a P40: the check fails before planning and names the fix."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=0: (6, 1))
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_75", "sm_80", "sm_86", "sm_90", "sm_100", "sm_120"])
    status, detail = doctor.check_torch_kernels()
    assert status == "fail"
    assert "sm_61" in detail and "download.pytorch.org/whl/cu126" in detail and "+cu126" in detail
    monkeypatch.setattr(torch.cuda, "get_arch_list", lambda: ["sm_50", "sm_60", "sm_70", "sm_75", "sm_80", "sm_90"])
    assert doctor.check_torch_kernels()[0] == "pass"
