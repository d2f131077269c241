"""Model zoo: encoder, encoder-decoder and vision models from transformers, compiled and compared with eager.

Each model is built tiny from a random config (no download), with every dropout set to 0 through its config
so training and eager compare exactly, and run in training (labels given, so the loss runs; loss and every
parameter gradient compared) and in inference (``torch.no_grad()``, eval; loss and logits compared), with
attn_implementation "eager" and "sdpa" where the model supports it. Most cases compile with the rewrite-only
backend (dynamo + the passes, the graph run as plain PyTorch); a few go through backend="flash" (Inductor).

What is asserted: no exception, numerics equal to eager's, and minimum rewrite counts where the pattern is
plainly there (each layer's attention, each LayerNorm, the loss's cross-entropy over a Linear). Where a
family is legitimately left alone, the case says why.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import transformers  # a test dependency, installed in CI (README)
from torch._dynamo.utils import counters

from flash_backend.backend import rewrite_only_backend
from fx_passes import collecting
from fx_passes._match import is_op

V = 101  # vocabulary
PADDED_ROWS_DIFFER = "padded query rows differ"  # see _deberta_v2_mlm
B, S = 2, 9  # batch, sequence
TOL = dict(atol=1e-4, rtol=1e-4)


def _grad_tol(want: torch.Tensor) -> dict:
    """TOL, with the absolute part grown to 16 fp32 ulps of the gradient's largest element: a parameter's
    gradient is a sum over the batch and the positions, so an element that nearly cancels carries the rounding
    of the large terms it sums (ViT-MAE's cls_token: elements up to ~1e3, one of 0.08 off by 5e-4 when the
    fused op sums in another order)."""
    scale = want.abs().max().item() if want.numel() else 0.0
    return dict(atol=max(TOL["atol"], 16 * torch.finfo(torch.float32).eps * scale), rtol=TOL["rtol"])
TEXT = dict(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            max_position_embeddings=64, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _ids(low=3):
    return torch.randint(low, V, (B, S))


def _pad_mask():
    am = torch.ones(B, S, dtype=torch.long)
    am[1, S - 3:] = 0  # the second sequence is padded
    return am


def _mlm_labels(ids):
    """Labels for 60% of the tokens, none on padding (what a data collator gives)."""
    return ids.masked_fill((torch.rand(ids.shape) < 0.4) | (_pad_mask() == 0), -100)


def _pixels(size=16, channels=3):
    return torch.randn(B, channels, size, size)


# --------------------------------------------------------------------------------------------------- builders
# Each returns (model, inputs, expected) where expected maps a family to the minimum rewrite count in training
# and inference with attn_implementation `impl`.


def _roberta_mlm(impl):
    cfg = transformers.RobertaConfig(**TEXT, pad_token_id=1, attn_implementation=impl)
    ids = _ids()
    inputs = {"input_ids": ids, "attention_mask": _pad_mask(), "labels": _mlm_labels(ids)}
    # 2 layers x (attention); LayerNorm: embeddings + 2 per layer + the LM head's (after a GELU, alone)
    return transformers.RobertaForMaskedLM(cfg), inputs, {"attention": 2, "norm": 6, "cross_entropy": 1}


def _xlm_roberta_cls(impl):
    cfg = transformers.XLMRobertaConfig(**TEXT, pad_token_id=1, num_labels=3, attn_implementation=impl)
    inputs = {"input_ids": _ids(), "attention_mask": _pad_mask(), "labels": torch.tensor([0, 2])}
    # the classifier head: dense -> tanh -> out_proj -> cross-entropy over out_proj
    return transformers.XLMRobertaForSequenceClassification(cfg), inputs, {
        "attention": 2, "norm": 5, "cross_entropy": 1}


def _distilbert_mlm(impl):
    cfg = transformers.DistilBertConfig(vocab_size=V, dim=32, n_layers=2, n_heads=2, hidden_dim=64,
                                        max_position_embeddings=64, dropout=0.0, attention_dropout=0.0,
                                        attn_implementation=impl)
    ids = _ids()
    inputs = {"input_ids": ids, "attention_mask": _pad_mask(), "labels": _mlm_labels(ids)}
    # embeddings LN, 2 per layer, vocab_layer_norm; the vocab projector's GELU follows vocab_transform
    return transformers.DistilBertForMaskedLM(cfg), inputs, {
        "attention": 2, "norm": 6, "cross_entropy": 1, "dense": 1}


def _albert_mlm(impl):
    cfg = transformers.AlbertConfig(**TEXT, embedding_size=16, classifier_dropout_prob=0.0,
                                    attn_implementation=impl)
    ids = _ids()
    inputs = {"input_ids": ids, "attention_mask": _pad_mask(), "labels": _mlm_labels(ids)}
    # ALBERT shares one layer's weights across its 2 layers: still 2 attention calls in the graph
    return transformers.AlbertForMaskedLM(cfg), inputs, {"attention": 2, "norm": 6, "cross_entropy": 1}


def _electra_cls(impl):
    cfg = transformers.ElectraConfig(**TEXT, embedding_size=16, num_labels=3, attn_implementation=impl)
    inputs = {"input_ids": _ids(), "attention_mask": _pad_mask(), "labels": torch.tensor([1, 0])}
    return transformers.ElectraForSequenceClassification(cfg), inputs, {
        "attention": 2, "norm": 5, "cross_entropy": 1}


def _deberta_v2_mlm(impl):
    cfg = transformers.DebertaV2Config(**TEXT, relative_attention=True, position_buckets=8,
                                       pos_att_type=["p2c", "c2p"], max_relative_positions=16)
    ids = _ids()
    inputs = {"input_ids": ids, "attention_mask": _pad_mask(), "labels": _mlm_labels(ids)}
    # The disentangled c2p/p2c bias is added to the scores, then masked_fill(~mask, finfo.min) and a softmax:
    # attention with a float bias, rewritten. Its (B, 1, S, S) mask also masks the padded *query* rows, every
    # key of them: there the op gives 0 and eager a uniform average (a documented gap, reported), so those
    # rows are compared for no model output (their labels are -100, the loss does not see them).
    return transformers.DebertaV2ForMaskedLM(cfg), inputs, {
        "attention": 2, "norm": 6, "cross_entropy": 1, PADDED_ROWS_DIFFER: True}


def _mpnet_mlm(impl):
    cfg = transformers.MPNetConfig(**TEXT)  # its bias takes 32 buckets whatever the config says
    ids = _ids()
    inputs = {"input_ids": ids, "attention_mask": _pad_mask(), "labels": _mlm_labels(ids)}
    return transformers.MPNetForMaskedLM(cfg), inputs, {"attention": 2, "norm": 6, "cross_entropy": 1}


def _t5(impl):
    cfg = transformers.T5Config(vocab_size=V, d_model=32, d_kv=16, d_ff=64, num_layers=1,
                                num_decoder_layers=1, num_heads=2, dropout_rate=0.0, decoder_start_token_id=0,
                                pad_token_id=0, attn_implementation=impl)
    ids = _ids()
    labels = torch.randint(3, V, (B, 7))
    labels[1, -2:] = -100
    inputs = {"input_ids": ids, "attention_mask": _pad_mask(), "labels": labels}
    # encoder self, decoder self and cross attention; RMSNorm (T5LayerNorm): 2 + final in the encoder,
    # 3 + final in the decoder
    return transformers.T5ForConditionalGeneration(cfg), inputs, {
        "attention": 3, "norm": 7, "cross_entropy": 1}


def _seq2seq_cfg(cls, impl, **extra):
    return cls(vocab_size=V, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=2,
               decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
               dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, bos_token_id=0,
               eos_token_id=2, decoder_start_token_id=2, attn_implementation=impl, **extra)


def _seq2seq_inputs():
    labels = torch.randint(3, V, (B, 7))
    labels[1, -2:] = -100
    return {"input_ids": _ids(), "attention_mask": _pad_mask(), "labels": labels}


def _bart(impl):
    cfg = _seq2seq_cfg(transformers.BartConfig, impl)
    # LayerNorms: embeddings x2, encoder layer 2, decoder layer 3; lm_head has no bias (final_logits_bias is
    # added after it, so the cross-entropy's logits are not a Linear's output)
    return transformers.BartForConditionalGeneration(cfg), _seq2seq_inputs(), {"attention": 3, "norm": 7}


def _mbart(impl):
    cfg = _seq2seq_cfg(transformers.MBartConfig, impl)
    # pre-norm: embeddings x2, layer norms 2 + 3, final encoder/decoder norms
    return transformers.MBartForConditionalGeneration(cfg), _seq2seq_inputs(), {"attention": 3, "norm": 9}


def _pegasus(impl):
    cfg = _seq2seq_cfg(transformers.PegasusConfig, impl)
    return transformers.PegasusForConditionalGeneration(cfg), _seq2seq_inputs(), {"attention": 3, "norm": 7}


def _whisper_cls(impl):
    cfg = transformers.WhisperConfig(vocab_size=V, num_mel_bins=8, d_model=32, encoder_layers=2,
                                     encoder_attention_heads=2, decoder_layers=1, decoder_attention_heads=2,
                                     encoder_ffn_dim=64, decoder_ffn_dim=64, max_source_positions=8,
                                     max_target_positions=16, dropout=0.0, attention_dropout=0.0,
                                     activation_dropout=0.0, num_labels=3, pad_token_id=1, bos_token_id=0,
                                     eos_token_id=2, decoder_start_token_id=2, attn_implementation=impl)
    inputs = {"input_features": torch.randn(B, 8, 16), "labels": torch.tensor([2, 0])}
    # 2 layers x 2 LayerNorms + the encoder's final one; the projector + classifier head: the classifier is a
    # Linear over the mean-pooled projection, then cross-entropy
    return transformers.WhisperForAudioClassification(cfg), inputs, {
        "attention": 2, "norm": 5, "cross_entropy": 1}


def _clip_text(impl):
    cfg = transformers.CLIPTextConfig(vocab_size=V, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=32,
                                      attention_dropout=0.0, bos_token_id=0, eos_token_id=2,
                                      attn_implementation=impl)
    return transformers.CLIPTextModel(cfg), {"input_ids": _ids(), "attention_mask": _pad_mask()}, {
        "attention": 2, "norm": 5}


def _clip_vision(impl):
    cfg = transformers.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=2, image_size=16, patch_size=8,
                                        attention_dropout=0.0, attn_implementation=impl)
    # pre_layrnorm, 2 per layer, post_layernorm
    return transformers.CLIPVisionModel(cfg), {"pixel_values": _pixels()}, {"attention": 2, "norm": 6}


def _clip(impl):
    text = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=32, bos_token_id=0, eos_token_id=2)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=16, patch_size=8)
    cfg = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=16,
                                  attn_implementation=impl)
    inputs = {"input_ids": _ids(), "attention_mask": _pad_mask(), "pixel_values": _pixels(),
              "return_loss": True}
    # the contrastive loss is two cross-entropies over (text_embeds @ image_embeds.t()) * scale: a matmul of
    # activations, not a Linear's logits: left to Inductor, reported as near misses
    return transformers.CLIPModel(cfg), inputs, {"attention": 2, "norm": 7, "cross_entropy_skipped": 2}


def _siglip(impl):
    text = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2, max_position_embeddings=16)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=16, patch_size=8)
    cfg = transformers.SiglipConfig(text_config=text, vision_config=vision, attn_implementation=impl)
    ids = torch.randint(3, V, (B, 16))
    # SigLIP's text model pools the last token and takes no padding mask in its reference use
    inputs = {"input_ids": ids, "pixel_values": _pixels(), "return_loss": True}
    # text: 2 per layer + final; vision: 2 per layer + post_layernorm + the attention-pooling head's. The
    # pooling head's nn.MultiheadAttention reaches the graph as one F.multi_head_attention_forward call
    # (dynamo does not inline it): no attention candidate there, so 2 attention rewrites, not 3 (reported
    # to the attention pass's owner). The sigmoid loss has no cross-entropy.
    return transformers.SiglipModel(cfg), inputs, {"attention": 2, "norm": 7}


VISION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=16,
              patch_size=8, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, drop_path_rate=0.0)


def _deit_cls(impl):
    cfg = transformers.DeiTConfig(**VISION, num_labels=5, attn_implementation=impl)
    inputs = {"pixel_values": _pixels(), "labels": torch.tensor([4, 1])}
    return transformers.DeiTForImageClassification(cfg), inputs, {
        "attention": 2, "norm": 5, "cross_entropy": 1}


def _beit_cls(impl):
    cfg = transformers.BeitConfig(**VISION, num_labels=5, use_relative_position_bias=True,
                                  use_mean_pooling=True, layer_scale_init_value=0.1, attn_implementation=impl)
    inputs = {"pixel_values": _pixels(), "labels": torch.tensor([4, 1])}
    # the relative position bias is an additive float mask; the pooler's LayerNorm is on the mean of the
    # patch tokens
    return transformers.BeitForImageClassification(cfg), inputs, {
        "attention": 2, "norm": 5, "cross_entropy": 1}


def _data2vec_cls(impl):
    cfg = transformers.Data2VecVisionConfig(**VISION, num_labels=5, use_relative_position_bias=True,
                                            use_mean_pooling=True, attn_implementation=impl)
    inputs = {"pixel_values": _pixels(), "labels": torch.tensor([4, 1])}
    return transformers.Data2VecVisionForImageClassification(cfg), inputs, {
        "attention": 2, "norm": 5, "cross_entropy": 1}


def _swin_cls(impl):
    cfg = transformers.SwinConfig(image_size=32, patch_size=4, embed_dim=16, depths=[2, 1], num_heads=[1, 2],
                                  window_size=4, mlp_ratio=2.0, hidden_dropout_prob=0.0,
                                  attention_probs_dropout_prob=0.0, drop_path_rate=0.0, num_labels=5,
                                  attn_implementation=impl)
    inputs = {"pixel_values": _pixels(32), "labels": torch.tensor([4, 1])}
    # 3 blocks (the second of stage 1 shifted, with its per-window mask); LayerNorms: patch embeddings,
    # 2 per block, the patch merging's, the final one
    return transformers.SwinForImageClassification(cfg), inputs, {
        "attention": 3, "norm": 9, "cross_entropy": 1}


def _vit_mae(impl):
    cfg = transformers.ViTMAEConfig(**VISION, decoder_hidden_size=32, decoder_num_hidden_layers=1,
                                    decoder_num_attention_heads=2, decoder_intermediate_size=64,
                                    mask_ratio=0.5, attn_implementation=impl)
    noise = torch.rand(B, (16 // 8) ** 2)  # the random masking's noise, given so eager and compiled agree
    # encoder 2 layers + decoder 1; LayerNorms 2 per layer + the encoder's and decoder's final ones. The
    # loss is a masked MSE on pixels: no cross-entropy.
    return transformers.ViTMAEForPreTraining(cfg), {"pixel_values": _pixels(), "noise": noise}, {
        "attention": 3, "norm": 8}


def _convnext_cls(impl):
    cfg = transformers.ConvNextConfig(num_channels=3, patch_size=4, num_stages=2, hidden_sizes=[16, 32],
                                      depths=[1, 1], drop_path_rate=0.0, num_labels=5, image_size=16)
    inputs = {"pixel_values": _pixels(), "labels": torch.tensor([4, 1])}
    # no attention. LayerNorms over the channels of (B, H, W, C) tensors: the stem's and the downsampling's
    # (channels_first, permuted around nn.LayerNorm), one per block, the final one on the pooled features
    return transformers.ConvNextForImageClassification(cfg), inputs, {"norm": 5, "cross_entropy": 1}


BUILDERS = {
    "roberta_mlm": (_roberta_mlm, ("eager", "sdpa")),
    "xlm_roberta_cls": (_xlm_roberta_cls, ("sdpa",)),  # RoBERTa's modules: one implementation is enough
    "distilbert_mlm": (_distilbert_mlm, ("eager", "sdpa")),
    "albert_mlm": (_albert_mlm, ("eager", "sdpa")),
    "electra_cls": (_electra_cls, ("eager", "sdpa")),
    "deberta_v2_mlm": (_deberta_v2_mlm, ("eager",)),
    "mpnet_mlm": (_mpnet_mlm, ("eager",)),
    "t5": (_t5, ("eager", "sdpa")),
    "bart": (_bart, ("eager", "sdpa")),
    "mbart": (_mbart, ("eager",)),  # BART's attention; the pre-norm layers are what is new
    "pegasus": (_pegasus, ("sdpa",)),
    "whisper_cls": (_whisper_cls, ("eager", "sdpa")),
    "clip_text": (_clip_text, ("eager", "sdpa")),
    "clip_vision": (_clip_vision, ("eager", "sdpa")),
    "clip": (_clip, ("sdpa",)),  # the towers are covered with both implementations above
    "siglip": (_siglip, ("eager", "sdpa")),
    "deit_cls": (_deit_cls, ("eager", "sdpa")),
    "beit_cls": (_beit_cls, ("eager", "sdpa")),
    "data2vec_vision_cls": (_data2vec_cls, ("eager", "sdpa")),
    "swin_cls": (_swin_cls, ("eager", "sdpa")),
    "vit_mae": (_vit_mae, ("eager", "sdpa")),
    "convnext_cls": (_convnext_cls, ("eager",)),
}


def build(name, impl):
    torch.manual_seed(0)
    model, inputs, expected = BUILDERS[name][0](impl)
    for module in model.modules():  # what a config leaves (pooler dropouts)
        if isinstance(module, nn.Dropout):
            module.p = 0.0
        # stochastic depth is random in training, and it is not nn.Dropout: the configs set it to 0
        assert not getattr(module, "drop_prob", 0.0), f"{type(module).__name__} is random in training"
    return model, inputs, expected


# ---------------------------------------------------------------------------------------------------- running


def _outputs(out):
    """The tensors of a model output worth comparing: the loss first when there is one."""
    names = ["loss", "logits", "last_hidden_state", "logits_per_text", "pooler_output"]
    return {n: getattr(out, n) for n in names if isinstance(getattr(out, n, None), torch.Tensor)}


def _objective(outs):
    if "loss" in outs:
        return outs["loss"]
    return sum(t.float().square().mean() for t in outs.values())


def _step(model, inputs, training):
    model.train(training)
    params = [p for p in model.parameters() if p.requires_grad]
    if not training:
        with torch.no_grad():
            return _outputs(model(**inputs)), {}
    outs = _outputs(model(**inputs))
    grads = torch.autograd.grad(_objective(outs), params, allow_unused=True)
    module = getattr(model, "_orig_mod", model)  # a compiled model's names carry a _orig_mod. prefix
    names = [n for n, p in module.named_parameters() if p.requires_grad]
    return outs, {n: g for n, g in zip(names, grads, strict=True) if g is not None}


def run_case(name, impl, training, backend=rewrite_only_backend):
    """(eager outputs and grads, compiled outputs and grads, counters, report) for one case."""
    model, inputs, expected = build(name, impl)
    compiled = copy.deepcopy(model)
    ref = _step(model, inputs, training)
    torch._dynamo.reset()
    counters.clear()
    with collecting() as report:
        got = _step(torch.compile(compiled, backend=backend), inputs, training)
    return ref, got, dict(counters["flash"]), report, expected


def check(name, impl, training, backend=rewrite_only_backend):
    (ref_out, ref_grads), (out, grads), flash, report, expected = run_case(name, impl, training, backend)
    assert out.keys() == ref_out.keys()
    padded_rows_differ = expected.pop(PADDED_ROWS_DIFFER, False)
    for key in ref_out:
        got, want = out[key], ref_out[key]
        if padded_rows_differ and want.dim() >= 2 and want.shape[:2] == (B, S):
            keep = _pad_mask().bool()
            got, want = got[keep], want[keep]
        torch.testing.assert_close(got, want, **TOL, msg=lambda m, key=key: f"{key}: {m}\n{report}")
    if padded_rows_differ:
        assert "taken as -inf" in str(report), str(report)
    assert grads.keys() == ref_grads.keys()
    for key in ref_grads:
        torch.testing.assert_close(grads[key], ref_grads[key], **_grad_tol(ref_grads[key]),
                                   msg=lambda m, key=key: f"grad {key}: {m}\n{report}")
    for family, minimum in expected.items():
        assert flash.get(family, 0) >= minimum, f"{family}: {flash}\n{report}"
    return flash, report


CASES = [(n, i) for n, (_, impls) in BUILDERS.items() for i in impls]


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize(("name", "impl"), CASES, ids=[f"{n}-{i}" for n, i in CASES])
def test_model_zoo_rewrite_only(name, impl, training):
    check(name, impl, training)


# ------------------------------------------------------------------------------------------ regression tests
# Focused modules for what the sweep found, each failing (or missing its rewrite) before the fix.


def _compare_module(module, args, training, families):
    """module compiled with the rewrite-only backend against eager (outputs, and parameter gradients in
    training); returns (counters["flash"], the report, the graphs' fused calls)."""
    module.train(training)
    compiled = copy.deepcopy(module)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.graph)
        return rewrite_only_backend(gm, example_inputs)

    torch._dynamo.reset()
    counters.clear()
    with torch.set_grad_enabled(training):
        ref = module(*args)
        with collecting() as report:
            out = torch.compile(compiled, backend=backend)(*args)
    for r, o in zip(ref, out, strict=True):
        torch.testing.assert_close(o, r, **TOL, msg=lambda m: f"{m}\n{report}")
    if training:
        sum(t.float().square().sum() for t in ref).backward()
        sum(t.float().square().sum() for t in out).backward()
        for (name, pc), pe in zip(compiled.named_parameters(), module.parameters(), strict=True):
            torch.testing.assert_close(pc.grad, pe.grad, **TOL, msg=lambda m, name=name: f"{name}: {m}")
    fused = [n for g in graphs for n in g.nodes
             if n.op == "call_function" and getattr(n.target, "__name__", None) in families]
    return dict(counters["flash"]), report, fused


class SharedDropoutResidual(nn.Module):
    """DistilBERT's first layer (BART's too): the embeddings' dropout output feeds the attention and is the
    residual of the first add + LayerNorm; `second` puts a dropout of its own on the other operand."""

    def __init__(self, p, second=False):
        super().__init__()
        self.emb_norm, self.norm = nn.LayerNorm(32), nn.LayerNorm(32)
        self.drop, self.drop2 = nn.Dropout(p), (nn.Dropout(p) if second else nn.Identity())
        self.proj = nn.Linear(32, 32)

    def forward(self, x):
        h = self.drop(self.emb_norm(x))
        return (self.norm(self.drop2(self.proj(h)) + h),)


@pytest.mark.parametrize("second", [False, True], ids=["plain_residual", "other_operand_dropped"])
@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
def test_dropout_with_other_users_is_the_residual_not_a_near_miss(training, second):
    """The shared dropout cannot be folded (its mask would be drawn twice), but the add + LayerNorm is still
    there: it was a near miss (DistilBERT 5 of 6 LayerNorms, BART 5 of 7); now the dropout stays in the
    graph as the residual operand and only a dropout of the other operand is folded."""
    torch.manual_seed(0)
    flash, report, fused = _compare_module(SharedDropoutResidual(0.0, second), (torch.randn(2, 5, 32),),
                                           training, {"add_dropout_norm"})
    assert flash.get("norm") == 2 and not flash.get("norm_skipped"), str(report)
    # with p > 0 (structure only: the masks are random): the shared dropout stays, the other is folded
    torch.manual_seed(0)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.graph)
        return rewrite_only_backend(gm, example_inputs)

    torch._dynamo.reset()
    torch.compile(SharedDropoutResidual(0.3, second).train(), backend=backend)(torch.randn(2, 5, 32))
    (graph,) = graphs
    dropouts = [n for n in graph.nodes if is_op(n, "dropout")]
    norms = [n for n in graph.nodes if getattr(n.target, "__name__", None) == "add_dropout_norm"]
    assert len(dropouts) == 1 and len(norms) == 2
    residual_norm = next(n for n in norms if n.args[1] is not None)
    assert residual_norm.args[1] is dropouts[0]  # the shared dropout's output is the residual operand
    assert residual_norm.kwargs["dropout_p"] == (0.3 if second else 0.0)


class BiasAddedHead(nn.Module):
    """BART / mBART / Pegasus: ``lm_head(h) + final_logits_bias`` (a bias-free Linear, a (1, V) buffer)."""

    def __init__(self, bias_shape=(1, 37), linear_bias=False, bias_first=False, parameter=False,
                 also_raw=False):
        super().__init__()
        self.head = nn.Linear(16, 37, bias=linear_bias)
        bias = torch.randn(bias_shape)
        if parameter:
            self.class_bias = nn.Parameter(bias)
        else:
            self.register_buffer("class_bias", bias)
        self.bias_first, self.also_raw = bias_first, also_raw

    def forward(self, x, labels):
        raw = self.head(x)
        logits = self.class_bias + raw if self.bias_first else raw + self.class_bias
        loss = nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), labels.view(-1))
        return (loss, logits, raw * 2) if self.also_raw else (loss, logits)


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("kind", ["buffer_1xV", "parameter_V", "bias_first", "bias_1x1xV"])
def test_class_bias_added_to_the_logits_is_folded(kind, training):
    """A loss over ``Linear(x) + class bias`` was a near miss ("the logits pass through add"); the bias
    becomes the op's and gradients reach it when it is a parameter."""
    torch.manual_seed(0)
    model = BiasAddedHead(bias_shape=(37,) if kind == "parameter_V" else (1, 1, 37) if kind == "bias_1x1xV"
                          else (1, 37), parameter=kind == "parameter_V", bias_first=kind == "bias_first")
    args = (torch.randn(2, 5, 16), torch.randint(0, 37, (2, 5)))
    flash, report, fused = _compare_module(model, args, training, {"linear_cross_entropy"})
    assert flash.get("cross_entropy") == 1 and not flash.get("cross_entropy_skipped"), str(report)
    assert len(fused) == 1 and fused[0].args[2] is not None
    assert "add" in str(report)


@pytest.mark.parametrize(("kind", "reason"), [
    ("linear_has_bias", "second bias"),
    ("raw_logits_read", "also read without the added bias"),
    ("not_a_class_bias", "pass through add"),
    ("bias_changes_dtype", "changes their dtype"),
])
def test_added_bias_near_misses(kind, reason):
    torch.manual_seed(0)
    model = BiasAddedHead(linear_bias=kind == "linear_has_bias", also_raw=kind == "raw_logits_read",
                          bias_shape=(5, 37) if kind == "not_a_class_bias" else (1, 37))
    if kind == "bias_changes_dtype":
        model.class_bias = model.class_bias.double()
    args = (torch.randn(2, 5, 16), torch.randint(0, 37, (2, 5)))
    flash, report, fused = _compare_module(model, args, True, {"linear_cross_entropy"})
    assert not flash.get("cross_entropy") and flash.get("cross_entropy_skipped") == 1, str(report)
    assert reason in str(report), str(report)


# ------------------------------------------------------------------------------- end to end (backend="flash")
# Inductor on CPU is slow: a few cases (a training step with every family; the folded class bias and the
# shared dropout; a model without attention, its LayerNorms between permutes, in training).

FLASH_CASES = [("roberta_mlm", "sdpa", True), ("bart", "eager", False), ("convnext_cls", "eager", True)]


@pytest.mark.parametrize(("name", "impl", "training"), FLASH_CASES,
                         ids=[f"{n}-{i}-{'train' if t else 'eval'}" for n, i, t in FLASH_CASES])
def test_model_zoo_flash_backend(name, impl, training):
    from torch._inductor.utils import fresh_inductor_cache

    with fresh_inductor_cache():
        check(name, impl, training, backend="flash")


class StoredLossHead(nn.Module):
    """DistilBERT's MLM head keeps its loss as a module, ``self.mlm_loss_fct = nn.CrossEntropyLoss()``."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 37)
        self.loss_fct = nn.CrossEntropyLoss(label_smoothing=0.1)

    def forward(self, x, labels):
        logits = self.proj(x)
        return self.loss_fct(logits.view(-1, 37), labels.view(-1)), logits


def test_module_loss_under_dynamic_shapes_is_rewritten_and_guarded():
    """With dynamic=True the stored loss module's label_smoothing is a graph input (a SymFloat): it was a
    near miss ("not a constant"); now it is specialised (dynamo restarts with it a constant) and guarded, so
    a changed value recompiles instead of reusing the baked one."""
    torch.manual_seed(0)
    model = StoredLossHead()
    compiled_model = copy.deepcopy(model)
    compiled = torch.compile(compiled_model, backend=rewrite_only_backend, dynamic=True)
    counters.clear()
    for batch, smoothing in ((2, 0.1), (3, 0.1), (3, 0.3)):
        model.loss_fct.label_smoothing = compiled_model.loss_fct.label_smoothing = smoothing
        x, labels = torch.randn(batch, 5, 16), torch.randint(0, 37, (batch, 5))
        with collecting() as report:
            loss, logits = compiled(x, labels)
        ref_loss, ref_logits = model(x, labels)
        torch.testing.assert_close(loss, ref_loss, **TOL)
        torch.testing.assert_close(logits, ref_logits, **TOL)
        grads = torch.autograd.grad(loss, list(compiled_model.parameters()))
        ref_grads = torch.autograd.grad(ref_loss, list(model.parameters()))
        for g, r in zip(grads, ref_grads, strict=True):
            torch.testing.assert_close(g, r, **TOL)
    assert not counters["flash"]["cross_entropy_skipped"], str(report)
    # one compile for the dynamic batch, one more for the changed label_smoothing
    assert counters["flash"]["cross_entropy"] == 2, dict(counters["flash"])
