"""Chains whose models differ in dtype and device. CUDA tests are marked and skip without a GPU."""

import types

import pytest
import torch

from helpers import assert_every_level_took_part, assert_target_could_sample

import hf_polybasic as hp
from hf_polybasic.testing import prompt

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture
def fp32_chain(shared_models):
    return shared_models.chain("llama", 3, seed=31)


def _cast(model, dtype=None, device=None):
    copy = type(model)(model.config).eval()
    copy.load_state_dict(model.state_dict())
    copy.generation_config = model.generation_config
    return copy.to(device=device, dtype=dtype)


CONFIG = hp.PolybasicConfig(schedule="constant")  # every level drafts in every round


def _greedy_pair(target, assistants, ids, **options):
    """(chain output, plain output); asserts that every level of the chain drafted and verified."""
    options = dict(do_sample=False, max_new_tokens=24, eos_token_id=None, **options)
    reference = target.generate(ids, **options)
    out = target.generate(ids, custom_generate=hp.generate, assistant_models=assistants, polybasic_config=CONFIG,
                          return_dict_in_generate=True, **options)
    assert_every_level_took_part(out.polybasic_stats, rejections=False, acceptances=False)
    return out.sequences, reference


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_assistants_under_an_fp32_target(dtype, fp32_chain):
    target, m2, m3 = fp32_chain
    out, reference = _greedy_pair(target, [_cast(m2, dtype), _cast(m3, dtype)], prompt(5, seed=2))
    assert torch.equal(out, reference)


def test_low_precision_assistants_sample_what_the_target_can_sample(fp32_chain):
    """bf16 assistants report bf16-computed proposals in float32; every sampled token is one the
    fp32 target can sample (top_k=3), and every level took part. (Exactness of the distribution
    does not depend on the assistants' dtype: see test_sampling_distribution.)"""
    target, m2, m3 = fp32_chain
    torch.manual_seed(0)
    ids = prompt(5)
    out = target.generate(
        ids,
        do_sample=True,
        top_k=3,
        max_new_tokens=16,
        eos_token_id=None,
        custom_generate=hp.generate,
        assistant_models=[_cast(m2, torch.bfloat16), _cast(m3, torch.bfloat16)],
        polybasic_config=CONFIG,
        return_dict_in_generate=True,
    )
    assert out.sequences.shape[1] == 5 + 16
    assert_every_level_took_part(out.polybasic_stats, rejections=False, acceptances=False)
    assert_target_could_sample(target, out.sequences, ids.shape[1], top_k=3)


class _FixedLogits(torch.nn.Module):
    """A "target" whose logits are ``row`` at every position."""

    def __init__(self, row):
        super().__init__()
        self.row = row

    def forward(self, ids):
        return types.SimpleNamespace(logits=self.row.expand(ids.shape[0], ids.shape[1], -1))


def test_the_top_k_check_allows_every_id_tied_with_the_kth_value_and_nothing_below():
    """transformers' top-k keeps every id whose score equals the k-th largest (ids 2 and 3 here, tied
    3rd in bf16), so a chain may sample either; topk(3).indices keeps only one of them."""
    from transformers.generation.logits_process import TopKLogitsWarper

    row = torch.tensor([5.0, 4.0, 3.0, 3.0, 1.0, 0.5], dtype=torch.bfloat16)
    kept = torch.isfinite(TopKLogitsWarper(top_k=3)(None, row[None].clone()))[0]
    assert kept.tolist() == [True, True, True, True, False, False]
    target = _FixedLogits(row)
    assert_target_could_sample(target, torch.tensor([[1, 0, 1, 2, 3]]), 2, top_k=3)  # both tied ids
    for outside in (4, 5):
        with pytest.raises(AssertionError, match="probability 0"):
            assert_target_could_sample(target, torch.tensor([[1, 0, 2, outside]]), 2, top_k=3)
    with pytest.raises(AssertionError, match="probability 0"):  # strict: ties do not widen it past the k-th value
        assert_target_could_sample(target, torch.tensor([[1, 0, 4]]), 2, top_k=4)


def test_a_bf16_chain_on_the_cpu_samples_a_token_tied_at_the_kth_logit(fp32_chain):
    """The CUDA test below on the CPU in bf16 (issue 31): with this seed the chain samples, at one
    position, the target's 4th id, whose bf16 logit equals the 3rd's exactly, which top_k=3 keeps."""
    target, m2, m3 = (_cast(m, dtype=torch.bfloat16) for m in fp32_chain)
    torch.manual_seed(3)
    sampled = target.generate(
        prompt(5), do_sample=True, top_k=3, max_new_tokens=16, eos_token_id=None, custom_generate=hp.generate,
        assistant_models=[m2, m3], polybasic_config=CONFIG, return_dict_in_generate=True,
    )
    assert sampled.sequences.shape[1] == 5 + 16
    assert_every_level_took_part(sampled.polybasic_stats, rejections=False, acceptances=False)
    assert_target_could_sample(target, sampled.sequences, 5, top_k=3)
    logits = target(sampled.sequences).logits[0, 4:-1]
    new = sampled.sequences[0, 5:]
    tied_outside = (logits.gather(-1, new[:, None]) == logits.topk(3, dim=-1).values[:, -1:]).squeeze(-1) & ~(
        logits.topk(3, dim=-1).indices == new[:, None]).any(-1)
    if not bool(tied_outside.any()):  # another CPU's bf16 kernels may round differently: the check above still ran
        pytest.skip("this CPU's bf16 logits have no tie at the sampled tokens")


@pytest.mark.cuda
@needs_cuda
def test_whole_chain_on_gpu(fp32_chain):
    target, m2, m3 = (_cast(m, device="cuda") for m in fp32_chain)
    out, reference = _greedy_pair(target, [m2, m3], prompt(5, seed=3).cuda())
    assert out.device.type == "cuda"
    assert torch.equal(out, reference)


@pytest.mark.cuda
@needs_cuda
def test_chain_split_between_gpu_and_cpu(fp32_chain):
    target, m2, m3 = fp32_chain
    gpu_target = _cast(target, device="cuda")
    out, reference = _greedy_pair(gpu_target, [_cast(m2, device="cuda"), m3], prompt(5, seed=4).cuda())
    assert torch.equal(out, reference)
    # and the other way round: target on CPU, middle model on the GPU
    out, reference = _greedy_pair(target, [_cast(m2, device="cuda"), m3], prompt(5, seed=4))
    assert torch.equal(out, reference)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_chain_on_gpu_samples_and_decodes(dtype, fp32_chain):
    target, m2, m3 = (_cast(m, dtype=dtype, device="cuda") for m in fp32_chain)
    fp32_target = _cast(fp32_chain[0], device="cuda")
    # greedy exactness is checked against an fp32 target (a half-precision target is not
    # bit-reproducible between 1-token and k-token forwards: near-ties may flip)
    out, reference = _greedy_pair(fp32_target, [m2, m3], prompt(5, seed=5).cuda())
    assert torch.equal(out, reference)
    torch.manual_seed(0)
    sampled = target.generate(
        prompt(5).cuda(),
        do_sample=True,
        top_k=3,
        max_new_tokens=16,
        eos_token_id=None,
        custom_generate=hp.generate,
        assistant_models=[m2, m3],
        polybasic_config=CONFIG,
        return_dict_in_generate=True,
        output_scores=True,
    )
    assert sampled.sequences.shape[1] == 5 + 16
    assert sampled.scores[0].device.type == "cuda"
    assert_every_level_took_part(sampled.polybasic_stats, rejections=False, acceptances=False)
    assert_target_could_sample(target, sampled.sequences, 5, top_k=3)


@pytest.mark.cuda
@needs_cuda
def test_nf4_copy_of_the_target_as_intermediate_on_gpu(fp32_chain):
    pytest.importorskip("bitsandbytes")
    from hf_polybasic.levels import quantized_copy

    target, _, m3 = fp32_chain
    gpu_target = _cast(target, device="cuda")
    nf4 = quantized_copy(gpu_target, "nf4")
    out, reference = _greedy_pair(gpu_target, [nf4, _cast(m3, device="cuda")], prompt(5, seed=6).cuda())
    assert torch.equal(out, reference)


@pytest.mark.cuda
@needs_cuda
def test_cpu_drafter_under_gpu_target_with_prefix_dependent_processors(fp32_chain):
    """A CPU drafter's logits meet the GPU sequence in processors that read it (repetition penalty,
    no-repeat-ngram), greedy and sampling."""
    target, m2, m3 = fp32_chain
    target, m2 = _cast(target, device="cuda"), _cast(m2, device="cuda")
    ids = prompt(5, seed=4).cuda()
    options = dict(repetition_penalty=1.3, no_repeat_ngram_size=3)
    out, reference = _greedy_pair(target, [m2, m3], ids, **options)
    assert torch.equal(out, reference)
    torch.manual_seed(0)
    sampled = target.generate(
        ids, do_sample=True, top_k=3, max_new_tokens=16, eos_token_id=None, custom_generate=hp.generate,
        assistant_models=[m2, m3], polybasic_config=CONFIG, return_dict_in_generate=True, **options,
    )
    assert sampled.sequences.shape[1] == 5 + 16
    assert_every_level_took_part(sampled.polybasic_stats, rejections=False, acceptances=False)


# --- GPU correctness by construction, checked on the CPU -------------------------------------------
def test_a_forward_is_timed_to_the_end_of_its_gpu_work(monkeypatch, fp32_chain):
    """On a GPU the clock must be read after the work ran, not after its launch: under an injected
    clock (and when measuring the curves) a timed forward synchronizes the devices its model lives
    on, inside the timed span."""
    from hf_polybasic import timing
    from hf_polybasic.runners.dynamic import CachedModel
    from hf_polybasic.compat import new_dynamic_cache
    from hf_polybasic.costs import forward_cost
    from hf_polybasic.costs import measure as measure_module
    from hf_polybasic.testing import SimulatedClock

    model = fp32_chain[0]
    clock = SimulatedClock()
    synchronized = []

    def synchronize(devices):
        synchronized.append(tuple(devices))
        clock.advance(0.5 if devices else 0.0)  # the queued work finishes here

    for module in (timing, measure_module):
        monkeypatch.setattr(module, "synchronize", synchronize)
    monkeypatch.setattr(measure_module, "cuda_devices", lambda m: ("cuda:7",))
    runner = CachedModel(model, new_dynamic_cache(model), role="target", clock=clock)
    runner._timer = timing.ForwardTimer(torch.device("cuda", 7), clock, ("cuda:7",))  # as on that GPU
    observed = []
    runner.cost_observer = type("Observer", (), {"observe": lambda self, tokens, seconds, rows=1: observed.append(seconds)})()
    runner.logits(prompt(5, seed=1)[0], 1)
    assert synchronized == [("cuda:7",)] and observed == [0.5]
    assert forward_cost(model, prompt(6), 2, repeats=3, clock=clock) == 0.5  # what measuring the curves sees


def test_decoding_forwards_are_timed_by_events_without_waiting_for_the_gpu(monkeypatch, fp32_chain):
    """With the wall clock on one GPU, a forward is bracketed by CUDA events and nothing waits: its
    seconds reach the cost observer once its end event has run, at a later forward."""
    from hf_polybasic import timing
    events = []

    class FakeEvent:
        def __init__(self, enable_timing=False):
            self.done, self.at = False, None
            events.append(self)

        def record(self):
            self.at = len(events)

        def query(self):
            return self.done

        def synchronize(self):
            raise AssertionError("a decoding forward waited for the GPU")

        def elapsed_time(self, end):
            return 250.0  # ms

    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(timing, "synchronize", lambda devices: (_ for _ in ()).throw(AssertionError("synchronized")))
    timer = timing.ForwardTimer(torch.device("cuda", 0), timing.DEFAULT_CLOCK, (torch.device("cuda", 0),))
    observed = []
    observer = type("Observer", (), {"observe": lambda self, tokens, seconds, rows=1: observed.append((tokens, seconds))})()
    timer.start()
    timer.stop(3, 1, observer)
    assert observed == [] and len(events) == 2  # its events have not run yet: nothing read, nothing waited for
    for event in events:
        event.done = True
    timer.start()
    timer.stop(5, 1, observer)  # the next forward: the first one's seconds are read now
    assert observed == [(3, 0.25)]
    split = timing.ForwardTimer(torch.device("cuda", 0), timing.DEFAULT_CLOCK, ("cuda:0", "cuda:1"))
    assert not split.events  # a model split over two GPUs: one queue's events cannot time it


def test_the_machine_description_names_the_models_gpus_not_the_current_one(monkeypatch):
    from hf_polybasic.costs import hardware
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"GPU #{torch.device(device).index}")
    assert hardware.describe_machine(["cpu"])["gpu"] is None
    assert hardware.describe_machine(["cuda:1", "cpu", "cuda:1"])["gpu"] == ["cuda:1: GPU #1"]


@pytest.mark.cuda
@needs_cuda
def test_cpu_input_ids_with_a_gpu_target_decode_on_the_gpu_and_return_on_the_cpu(fp32_chain):
    """The prompt is moved to the target's device once; processors built on the CPU (where generate
    builds them, beside input_ids) follow it; the output comes back where the input was."""
    target, m2, m3 = (_cast(m, device="cuda") for m in fp32_chain)
    ids = prompt(5, seed=7)
    options = dict(do_sample=False, max_new_tokens=20, min_new_tokens=18, repetition_penalty=1.3,
                   no_repeat_ngram_size=3, bad_words_ids=[[5]], eos_token_id=2)
    reference = target.generate(ids.cuda(), **options)
    out = target.generate(ids, custom_generate=hp.generate, assistant_models=[m2, m3], polybasic_config=CONFIG,
                          return_dict_in_generate=True, output_scores=True, **options)
    assert out.sequences.device.type == "cpu" and out.scores[0].device.type == "cpu"
    assert torch.equal(out.sequences, reference.cpu())
    assert_every_level_took_part(out.polybasic_stats, rejections=False, acceptances=False)
