"""AnnotateLLMSemantics: the semantic annotation passes in dependency order."""

from __future__ import annotations

import tvm
from tvm import relax

from .annotate_activation import AnnotateActivation
from .annotate_attention import AnnotateAttention
from .annotate_attention_mask import AnnotateAttentionMask
from .annotate_embedding import AnnotateEmbedding
from .annotate_kv_append import AnnotateKVAppend
from .annotate_layer_norm import AnnotateLayerNorm
from .annotate_linear import AnnotateLinear
from .annotate_lm_head import AnnotateLMHead
from .annotate_mlp import AnnotateMLP
from .annotate_residual import AnnotateResidual
from .annotate_rms_norm import AnnotateRMSNorm
from .annotate_rope import AnnotateRoPE
from .additive_mask import AdditiveAttentionMask
from .per_head_norm import PerHeadLayerNorm
from .scalar_scalings import FoldScalarScalings
from .remove_identity_casts import RemoveIdentityCasts


def semantic_passes() -> list:
    """The passes, in order. Why this order:

    - constants folded first: exporters compute some constants in the graph (GPT-2's
      attention scale ``sqrt(1 / sqrt(head_dim))``, Gemma's ``1 + weight``), and a pattern
      that expects a constant would not see one;
    - identity casts next: they sit between the ops the patterns look for;
    - two scalings by constant scalars in a row become one (a pattern takes one scaling
      of the attention scores);
    - a LayerNorm per head (split, one norm per slice, concat) becomes one norm with a
      gain per head before any norm pattern looks;
    - a masked fill before a softmax becomes an added mask (MPT's ALiBi attention), the
      form the attention pattern takes; before the mask pattern, which may then claim
      the new mask's construction;
    - LayerNorm before RMSNorm: a spelled-out LayerNorm ends in an RMSNorm of the centred
      input (Cohere's), which RMSNorm would claim, leaving the centring on the host;
    - norms, RoPE and KV append before attention: they are attention's inputs, and a
      wildcard input may be a region output but never absorbs one;
    - MLP and lm_head before linear: they contain projections and claim them first;
    - activations after MLP: the MLP claims its own, the rest are standalone;
    - residual last: it is recognised next to the block regions.
    """
    return [
        relax.transform.FoldConstant(),
        RemoveIdentityCasts(),
        FoldScalarScalings(),
        PerHeadLayerNorm(),
        AdditiveAttentionMask(),
        AnnotateEmbedding(),
        AnnotateAttentionMask(),
        AnnotateLayerNorm(),
        AnnotateRMSNorm(),
        AnnotateRoPE(),
        AnnotateKVAppend(),
        AnnotateAttention(),
        AnnotateMLP(),
        AnnotateActivation(),
        AnnotateLMHead(),
        AnnotateLinear(),
        AnnotateResidual(),
    ]


def AnnotateLLMSemantics() -> tvm.transform.Pass:  # noqa: N802 (pass factory, TVM style)
    """All semantic annotation passes as one ``tvm.transform.Sequential``.

    The result keeps every op: recognised regions become composite functions
    (``"Composite": "edgetvm.<kind>"``, ``Primitive``), the rest stays ordinary Relax,
    and ``tvm.compile`` builds either unchanged.
    """
    return tvm.transform.Sequential(semantic_passes(), name="AnnotateLLMSemantics")
