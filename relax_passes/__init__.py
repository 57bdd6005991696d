"""Relax-level passes of edgetvm.

LLM semantics: the ``Annotate*`` passes recognise transformer building blocks in the
ONNX-imported Relax graph and group each into a composite function carrying its
parameters; ``semantic_report`` measures what they recognised.
"""

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
from .per_head_norm import PerHeadLayerNorm
from .scalar_scalings import FoldScalarScalings
from .remove_identity_casts import RemoveIdentityCasts
from .pipeline import AnnotateLLMSemantics, semantic_passes
from .quantize_w4a16 import QuantizeW4A16
from .semantic_report import COVERAGE_DEFINITION, LayerSummary, SemanticReport, semantic_report

__all__ = [
    "AnnotateActivation",
    "AnnotateAttention",
    "AnnotateAttentionMask",
    "AnnotateEmbedding",
    "AnnotateKVAppend",
    "AnnotateLayerNorm",
    "AnnotateLinear",
    "AnnotateLMHead",
    "AnnotateLLMSemantics",
    "AnnotateMLP",
    "AnnotateResidual",
    "AnnotateRMSNorm",
    "AnnotateRoPE",
    "COVERAGE_DEFINITION",
    "FoldScalarScalings",
    "PerHeadLayerNorm",
    "QuantizeW4A16",
    "RemoveIdentityCasts",
    "LayerSummary",
    "SemanticReport",
    "semantic_passes",
    "semantic_report",
]
