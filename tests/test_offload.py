import copy

import pytest
import torch
from torch import nn

import rlanywhere.offload as offload
from rlanywhere.offload import (
    current_device,
    load_optimizer_state,
    offload_model,
    offload_optimizer_state,
    on_device,
)


class TiedNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.hidden = nn.Linear(4, 4)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight  # tied, as in Qwen2.5-0.5B
        self.register_buffer("scale", torch.tensor([2.0, 3.0, 4.0, 5.0]))

    def forward(self, ids):
        return self.head(torch.tanh(self.hidden(self.embed(ids))) * self.scale)


def _train_step(model, optimizer, seed):
    torch.manual_seed(seed)
    ids = torch.randint(0, 10, (6,))
    optimizer.zero_grad()
    nn.functional.cross_entropy(model(ids), torch.randint(0, 10, (6,))).backward()
    optimizer.step()


def _setup():
    torch.manual_seed(0)
    model = TiedNet()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, amsgrad=True)
    _train_step(model, optimizer, seed=1)
    return model, optimizer


def test_round_trip_to_same_device_keeps_identity_and_values():
    model, optimizer = _setup()
    params = {name: (p, p.data.data_ptr(), p.detach().clone()) for name, p in model.named_parameters()}
    state_before = {id(p): {k: v for k, v in s.items()} for p, s in optimizer.state.items()}
    offload_optimizer_state(optimizer, "cpu")
    load_optimizer_state(optimizer, "cpu")
    offload_model(model, "cpu")
    for name, p in model.named_parameters():
        assert p is params[name][0] and p.data_ptr() == params[name][1]
        assert torch.equal(p, params[name][2])
    for p, s in optimizer.state.items():
        for k, v in s.items():
            assert v is state_before[id(p)][k]


def test_optimizer_step_after_round_trip_equals_step_without():
    model_a, opt_a = _setup()
    model_b = copy.deepcopy(model_a)
    opt_b = torch.optim.AdamW(model_b.parameters(), lr=0.1, amsgrad=True)
    opt_b.load_state_dict(copy.deepcopy(opt_a.state_dict()))  # load_state_dict alone shares the state tensors
    offload_optimizer_state(opt_b, "cpu")
    offload_model(model_b, "cpu")
    with on_device(opt_b, "cpu"):
        load_optimizer_state(opt_b, "cpu")
    _train_step(model_a, opt_a, seed=2)
    _train_step(model_b, opt_b, seed=2)
    for (name, pa), pb in zip(model_a.named_parameters(), model_b.parameters()):
        assert torch.equal(pa, pb), name


def test_model_move_reaches_every_tensor_and_keeps_ties_and_parameter_identity(monkeypatch):
    # one CPU here, so record what the mover sees and hand back copies as if they lived elsewhere
    seen, returned = [], []

    def fake_move(self, key, tensor):
        seen.append(key)
        returned.append(tensor.clone())
        return returned[-1]

    monkeypatch.setattr(offload._Mover, "__call__", fake_move)
    model, optimizer = _setup()
    params_before = list(model.parameters())
    values_before = [p.detach().clone() for p in params_before]
    offload_model(model, "cuda:0")
    assert sorted(seen) == sorted(
        [("param", "embed.weight"), ("param", "hidden.weight"), ("param", "hidden.bias"),
         ("grad", "embed.weight"), ("grad", "hidden.weight"), ("grad", "hidden.bias"), ("buffer", "", "scale")]
    )
    ptrs_after = [p.data_ptr() for p in model.parameters()] + [p.grad.data_ptr() for p in model.parameters()]
    ptrs_after.append(model.scale.data_ptr())
    assert sorted(ptrs_after) == sorted(t.data_ptr() for t in returned)  # every tensor is now the moved one
    assert model.head.weight is model.embed.weight
    assert all(a is b for a, b in zip(params_before, model.parameters()))
    assert all(a is b for a, b in zip(params_before, optimizer.param_groups[0]["params"]))
    assert all(torch.equal(a, b) for a, b in zip(values_before, model.parameters()))


def test_optimizer_state_move_follows_torch_step_rule():
    model, optimizer = _setup()
    offload_optimizer_state(optimizer, "meta")
    for state in optimizer.state.values():
        assert state["exp_avg"].device.type == "meta"
        assert state["exp_avg_sq"].device.type == "meta"
        assert state["max_exp_avg_sq"].device.type == "meta"
        assert state["step"].device.type == "cpu"  # non-capturable: torch keeps step on the CPU
    assert current_device(optimizer) == torch.device("meta")

    param = nn.Parameter(torch.ones(3))
    capturable = torch.optim.Adam([param], capturable=True)
    capturable.state[param] = {"step": torch.tensor(1.0), "exp_avg": torch.ones(3), "exp_avg_sq": torch.ones(3)}
    offload_optimizer_state(capturable, "meta")
    assert all(v.device.type == "meta" for v in capturable.state[param].values())


def test_on_device_moves_in_and_back_out_even_on_error(monkeypatch):
    calls = []
    monkeypatch.setattr(offload, "move", lambda obj, device: calls.append(str(device)))
    model, optimizer = _setup()
    with on_device(model, "cuda:0"):
        calls.append("body")
    assert calls == ["cuda:0", "body", "cpu"]
    calls.clear()
    with pytest.raises(RuntimeError, match="boom"):
        with on_device(optimizer, "cuda:0", home="cpu"):
            raise RuntimeError("boom")
    assert calls == ["cuda:0", "cpu"]
    calls.clear()
    with on_device(optimizer, "cuda:0", enabled=False):
        pass
    assert calls == []


def test_type_errors_are_clear():
    with pytest.raises(TypeError, match="Optimizer"):
        offload_optimizer_state(object(), "cpu")
    with pytest.raises(TypeError, match="nn.Module"):
        offload_model(object(), "cpu")
