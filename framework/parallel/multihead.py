"""torch's `nn.MultiheadAttention` split over the tensor-parallel ranks by whole heads.

The module packs the query, key and value projections into one `in_proj_weight` (3E x E: all
of q, then k, then v) and computes attention in `F.multi_head_attention_forward` with
`self.num_heads`. A column split of the packed weight would hand rank 0 all of q and half of k;
heads need rank r to hold rows r of each of q, k and v. So the parameters stay what they are, by
name and by layout (DTensors whose placements describe the full tensor, so checkpoints of any
layout read back by name): `in_proj_weight` and `in_proj_bias` are split in contiguous rows
(Shard(0)), the separate `q/k/v_proj_weight` of a module with other key or value sizes by their
rows too (each rank's rows are whole heads), `bias_k`/`bias_v` over their features, the output
projection over its inputs (Shard(1)), its bias whole. In each forward the packed weight is
exchanged into this rank's heads of q, k and v (DTensor's redistribution to a strided layout,
whose backward exchanges the gradient back: the price of the packed layout, one all-gather
of the weight each way), the rank attends over its `num_heads / tp` heads, and the output
projection's partial sums are all-reduced once, as a row-split linear's.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class TensorParallelMultiheadAttention(nn.MultiheadAttention):
    """An `nn.MultiheadAttention` whose parameters `HeadsParallel` split (the class is swapped
    in place: names, parameters and state dict stay the module's own)."""

    tp_mesh = None  # the 1-D tensor-parallel mesh

    def forward(
        self,
        query,
        key,
        value,
        key_padding_mask=None,
        need_weights=True,
        attn_mask=None,
        average_attn_weights=True,
        is_causal=False,
    ):
        batched = query.dim() == 3
        if self.batch_first and batched:
            query, key, value = _seq_first(query, key, value)
        if not batched:
            query, key, value = (x.unsqueeze(1) for x in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        out, weights = self._attend(
            query, key, value, key_padding_mask, need_weights, attn_mask, is_causal
        )
        if need_weights:
            weights = self._all_heads(weights, average_attn_weights)
            weights = weights if batched else weights.squeeze(0)
        if not batched:
            out = out.squeeze(1)
        elif self.batch_first:
            out = out.transpose(1, 0)
        return out, weights

    def _attend(self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal):
        """F.multi_head_attention_forward's computation on this rank's heads (sequence-first
        inputs), the output projection's partial sums all-reduced."""
        tgt_len, bsz, embed_dim = query.shape
        heads = self.num_heads // self.tp_mesh.size()
        key_padding_mask = F._canonical_mask(
            mask=key_padding_mask,
            mask_name="key_padding_mask",
            other_type=F._none_or_dtype(attn_mask),
            other_name="attn_mask",
            target_type=query.dtype,
        )
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint.")
        if is_causal and key_padding_mask is None and not need_weights:
            attn_mask = None  # sdpa's is_causal instead
        else:
            attn_mask = F._canonical_mask(
                mask=attn_mask,
                mask_name="attn_mask",
                other_type=None,
                other_name="",
                target_type=query.dtype,
                check_other=False,
            )
            is_causal = is_causal and key_padding_mask is None
        q, k, v = self._project(query, key, value)
        attn_mask = self._local_mask(attn_mask, bsz, tgt_len)
        if self.bias_k is not None and self.bias_v is not None:
            k = torch.cat([k, self.bias_k.to_local().repeat(1, bsz, 1)])
            v = torch.cat([v, self.bias_v.to_local().repeat(1, bsz, 1)])
            attn_mask = _pad(attn_mask)
            key_padding_mask = _pad(key_padding_mask)
        q = q.view(tgt_len, bsz * heads, self.head_dim).transpose(0, 1)
        k = k.view(k.shape[0], bsz * heads, self.head_dim).transpose(0, 1)
        v = v.view(v.shape[0], bsz * heads, self.head_dim).transpose(0, 1)
        if self.add_zero_attn:
            zeros = torch.zeros((bsz * heads, 1, self.head_dim), dtype=k.dtype, device=k.device)
            k, v = torch.cat([k, zeros], dim=1), torch.cat([v, zeros], dim=1)
            attn_mask = _pad(attn_mask)
            key_padding_mask = _pad(key_padding_mask)
        src_len = k.size(1)
        if key_padding_mask is not None:
            key_padding_mask = (
                key_padding_mask.view(bsz, 1, 1, src_len)
                .expand(-1, heads, -1, -1)
                .reshape(bsz * heads, 1, src_len)
            )
            attn_mask = key_padding_mask if attn_mask is None else attn_mask + key_padding_mask
        dropout_p = self.dropout if self.training else 0.0
        if need_weights:
            scores = torch.bmm(q * math.sqrt(1.0 / q.shape[-1]), k.transpose(-2, -1))
            if attn_mask is not None:
                scores = scores + attn_mask
            weights = F.softmax(scores, dim=-1)
            if dropout_p > 0.0:
                weights = F.dropout(weights, p=dropout_p)
            out = torch.bmm(weights, v).transpose(0, 1).reshape(tgt_len * bsz, -1)
            weights = weights.view(bsz, heads, tgt_len, src_len)
        else:
            if attn_mask is not None and attn_mask.size(0) == 1:
                attn_mask = attn_mask.unsqueeze(0)
            elif attn_mask is not None:
                attn_mask = attn_mask.view(bsz, heads, -1, src_len)
            q = q.view(bsz, heads, tgt_len, self.head_dim)
            k = k.view(bsz, heads, src_len, self.head_dim)
            v = v.view(bsz, heads, src_len, self.head_dim)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal)
            out = out.permute(2, 0, 1, 3).reshape(bsz * tgt_len, -1)
            weights = None
        out = self._output(out).view(tgt_len, bsz, embed_dim)
        return out, weights

    def _project(self, query, key, value):
        """This rank's heads of q, k and v (sequence-first), the inputs' gradients summed over
        the ranks (each rank's heads give a part of them)."""
        from torch.distributed.tensor.placement_types import _StridedShard

        mesh = self.tp_mesh
        query, key, value = _replicated_inputs(mesh, query, key, value)
        packed = [_StridedShard(0, split_factor=3)]  # rows r of each of q, k and v
        bias = self.in_proj_bias
        b = (None,) * 3 if bias is None else bias.redistribute(mesh, packed).to_local().chunk(3)
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight.redistribute(mesh, packed).to_local().chunk(3)
        else:
            separate = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
            w = tuple(p.to_local() for p in separate)
        inputs = (query, key, value)
        return tuple(F.linear(x, wi, bi) for x, wi, bi in zip(inputs, w, b, strict=True))

    def _local_mask(self, attn_mask, bsz: int, tgt_len: int):
        """A per-head mask (batch x heads, tgt, src) cut to this rank's heads; a 2-D one given a
        batch dimension, as torch does."""
        if attn_mask is None:
            return None
        if attn_mask.dim() == 2:
            return attn_mask.unsqueeze(0)
        heads = self.num_heads // self.tp_mesh.size()
        first = self.tp_mesh.get_local_rank() * heads
        per_head = attn_mask.view(bsz, self.num_heads, tgt_len, -1)[:, first : first + heads]
        return per_head.reshape(bsz * heads, tgt_len, -1)

    def _output(self, out):
        """The output projection of this rank's heads, summed over the ranks, plus its bias."""
        from torch.distributed.tensor import DTensor, Partial, Replicate

        mesh = self.tp_mesh
        partial = F.linear(out, self.out_proj.weight.to_local())
        whole = DTensor.from_local(partial, mesh, [Partial()], run_check=False)
        out = whole.redistribute(mesh, [Replicate()]).to_local()
        bias = self.out_proj.bias
        return out if bias is None else out + bias.to_local()

    def _all_heads(self, weights, average: bool):
        """The attention weights over every head: averaged (a sum of each rank's part), or each
        head's (gathered)."""
        from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

        mesh = self.tp_mesh
        if average:
            part = weights.sum(dim=1) / self.num_heads
            whole = DTensor.from_local(part, mesh, [Partial()], run_check=False)
        else:
            whole = DTensor.from_local(weights, mesh, [Shard(1)], run_check=False)
        return whole.redistribute(mesh, [Replicate()]).to_local()


def _seq_first(query, key, value):
    """(batch, seq, features) -> (seq, batch, features), one transpose per distinct tensor."""
    if key is value:
        if query is key:
            query = key = value = query.transpose(1, 0)
        else:
            query, key = query.transpose(1, 0), key.transpose(1, 0)
            value = key
    else:
        query, key, value = (x.transpose(1, 0) for x in (query, key, value))
    return query, key, value


def _replicated_inputs(mesh, *inputs):
    """Each distinct input as it is, its gradient all-reduced over the ranks in backward."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    done: dict[int, torch.Tensor] = {}
    for x in inputs:
        if id(x) not in done:
            whole = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
            done[id(x)] = whole.to_local(grad_placements=[Partial()])
    return tuple(done[id(x)] for x in inputs)


def _pad(mask):
    return None if mask is None else F.pad(mask, (0, 1))


def heads_parallel():
    """A torch ParallelStyle splitting an `nn.MultiheadAttention` by whole heads (see the
    module docstring); made when asked, so that importing this module does not import
    torch.distributed.tensor."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    class Heads(ParallelStyle):
        def _apply(self, module: nn.Module, mesh) -> nn.Module:
            if not isinstance(module, nn.MultiheadAttention):
                raise ValueError(
                    f"the multihead_attention style splits nn.MultiheadAttention, not "
                    f"{type(module).__name__}"
                )
            if module.num_heads % mesh.size():
                raise ValueError(
                    f"{module.num_heads} heads do not split over tp={mesh.size()} ranks"
                )
            placements = {
                "in_proj_weight": Shard(0),
                "in_proj_bias": Shard(0),
                "q_proj_weight": Shard(0),
                "k_proj_weight": Shard(0),
                "v_proj_weight": Shard(0),
                "bias_k": Shard(2),
                "bias_v": Shard(2),
            }
            for owner, name, placement in [
                *((module, n, p) for n, p in placements.items()),
                (module.out_proj, "weight", Shard(1)),
                (module.out_proj, "bias", Replicate()),
            ]:
                param = getattr(owner, name, None)
                if param is None:
                    continue
                split = distribute_tensor(param.data, mesh, [placement])
                owner.register_parameter(name, nn.Parameter(split, param.requires_grad))
            module.__class__ = TensorParallelMultiheadAttention
            module.tp_mesh = mesh
            # torch's fast path for encoder layers (eval, no grad) calls a fused kernel with
            # the module's weights, which has no form for split ones
            torch.backends.mha.set_fastpath_enabled(False)
            return module

    return Heads()
