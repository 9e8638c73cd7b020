"""Names of a MindSpore dump in PyTorch's terms, so that the two frameworks' dumps compare.

`canonical_name(name, framework)` turns an entry name into the name PyTorch would give the
same call; `canonical_label(label, framework)` does the same for a tensor's label inside an
entry. PyTorch names are the canonical ones (they pass through unchanged), so two dumps of
the same model compare entry by entry once both sides are canonical:

======================================  ======================================
MindSpore                               PyTorch
======================================  ======================================
``Cell.<path>.<Class>.forward.<n>``     ``Module.<path>.<Class'>.forward.<n>`` (also backward,
                                        parameters_grad); Class' from `CELL_CLASSES`
                                        (``Dense`` -> ``Linear``, ``SequentialCell`` ->
                                        ``Sequential``...), other classes keep their name
``Functional.<f>`` (``mindspore.ops``)  ``Functional.<f'>`` for the torch.nn.functional ones
                                        (`OPS_TO_FUNCTIONAL`: ``dense`` -> ``linear``,
                                        ``relu``, ``softmax``...), else ``Torch.<f>``
``Mint.<f>`` (``mindspore.mint``)       ``Torch.<f>``
``MintFunctional.<f>``                  ``Functional.<f>``
``MintDistributed.<f>``                 ``Distributed.<f>``
``Tensor.<m>``, ``Distributed.<f>``     the same (operators keep their dunder names in both
                                        dumps, ``Tensor.__mul__``, as the predecessor writes them)
``Primitive.<attr>.<Class>``            no counterpart (a Primitive held by a Cell, e.g. the
                                        ``MatMul`` and ``BiasAdd`` of ``nn.Dense``: PyTorch's
                                        ``nn.Linear`` makes one ``Functional.linear`` call);
                                        left as is, so it stays unmatched while the Cell
                                        around it pairs with its Module
``parameters.gamma`` / ``beta``         ``parameters.weight`` / ``bias`` (`PARAMETERS`; also
                                        ``embedding_table``, ``moving_mean``/``moving_variance``)
======================================  ======================================

Cell paths are those of ``cells_and_names()`` and Module paths those of ``named_modules()``:
the same attribute names give the same paths (a ``SequentialCell``'s children are ``0``,
``1``... as a ``Sequential``'s), so a path needs no mapping.

Only MindSpore names are rewritten; PyTorch's and unknown frameworks' pass through. A call one
framework makes and the other does not (MindSpore's ``Tensor.T`` calls ``Tensor.permute``, which
is recorded; PyTorch's ``.T`` is not) stays unmatched, as do the Primitives above.
"""
from __future__ import annotations

from msprobe_engine.dump.schema import parse_entry_name

MINDSPORE = "mindspore"

#: MindSpore Cell class -> the PyTorch Module class of the same layer (others keep their name)
CELL_CLASSES = {
    "Dense": "Linear", "SequentialCell": "Sequential", "CellList": "ModuleList", "CellDict": "ModuleDict",
    "SoftmaxCrossEntropyWithLogits": "CrossEntropyLoss", "Conv1dTranspose": "ConvTranspose1d",
    "Conv2dTranspose": "ConvTranspose2d", "Conv3dTranspose": "ConvTranspose3d", "BiDense": "Bilinear",
}
#: mindspore.ops functions whose PyTorch counterpart is in torch.nn.functional (others: torch.<f>)
OPS_TO_FUNCTIONAL = {
    "dense": "linear", "bidense": "bilinear", "relu": "relu", "relu6": "relu6", "gelu": "gelu", "silu": "silu",
    "elu": "elu", "selu": "selu", "celu": "celu", "leaky_relu": "leaky_relu", "hardswish": "hardswish",
    "hardsigmoid": "hardsigmoid", "mish": "mish", "softplus": "softplus", "softsign": "softsign",
    "softmax": "softmax", "log_softmax": "log_softmax", "softmin": "softmin", "glu": "glu",
    "dropout": "dropout", "dropout1d": "dropout1d", "dropout2d": "dropout2d", "dropout3d": "dropout3d",
    "layer_norm": "layer_norm", "batch_norm": "batch_norm", "group_norm": "group_norm",
    "instance_norm": "instance_norm", "normalize": "normalize", "embedding": "embedding", "pad": "pad",
    "conv1d": "conv1d", "conv2d": "conv2d", "conv3d": "conv3d", "conv_transpose2d": "conv_transpose2d",
    "avg_pool1d": "avg_pool1d", "avg_pool2d": "avg_pool2d", "avg_pool3d": "avg_pool3d",
    "max_pool2d": "max_pool2d", "max_pool3d": "max_pool3d", "adaptive_avg_pool1d": "adaptive_avg_pool1d",
    "adaptive_avg_pool2d": "adaptive_avg_pool2d", "adaptive_avg_pool3d": "adaptive_avg_pool3d",
    "adaptive_max_pool1d": "adaptive_max_pool1d", "adaptive_max_pool2d": "adaptive_max_pool2d",
    "interpolate": "interpolate", "grid_sample": "grid_sample", "affine_grid": "affine_grid", "unfold": "unfold",
    "fold": "fold", "one_hot": "one_hot", "cosine_similarity": "cosine_similarity", "pdist": "pdist",
    "pixel_shuffle": "pixel_shuffle", "pixel_unshuffle": "pixel_unshuffle",
    "cross_entropy": "cross_entropy", "nll_loss": "nll_loss", "mse_loss": "mse_loss", "l1_loss": "l1_loss",
    "smooth_l1_loss": "smooth_l1_loss", "huber_loss": "huber_loss", "kl_div": "kl_div",
    "binary_cross_entropy": "binary_cross_entropy",
    "binary_cross_entropy_with_logits": "binary_cross_entropy_with_logits", "ctc_loss": "ctc_loss",
    "margin_ranking_loss": "margin_ranking_loss", "hinge_embedding_loss": "hinge_embedding_loss",
    "cosine_embedding_loss": "cosine_embedding_loss", "gaussian_nll_loss": "gaussian_nll_loss",
    "multi_margin_loss": "multi_margin_loss", "multilabel_margin_loss": "multilabel_margin_loss",
    "multilabel_soft_margin_loss": "multilabel_soft_margin_loss", "triplet_margin_loss": "triplet_margin_loss",
    "soft_margin_loss": "soft_margin_loss", "poisson_nll_loss": "poisson_nll_loss",
    "hardtanh": "hardtanh", "hardshrink": "hardshrink", "softshrink": "softshrink", "tanhshrink": "tanhshrink",
    "threshold": "threshold", "rrelu": "rrelu", "prelu": "prelu", "gumbel_softmax": "gumbel_softmax",
    "lp_pool1d": "lp_pool1d", "lp_pool2d": "lp_pool2d", "max_unpool1d": "max_unpool1d",
    "max_unpool2d": "max_unpool2d", "max_unpool3d": "max_unpool3d", "fractional_max_pool2d": "fractional_max_pool2d",
    "fractional_max_pool3d": "fractional_max_pool3d", "alpha_dropout": "alpha_dropout",
}
#: API prefixes of MindSpore -> PyTorch (``Functional`` goes through `OPS_TO_FUNCTIONAL`)
PREFIXES = {"Mint": "Torch", "MintFunctional": "Functional", "MintDistributed": "Distributed",
            "Tensor": "Tensor", "Distributed": "Distributed"}
#: MindSpore parameter names -> PyTorch's, in ``parameters.<name>`` and ``parameters_grad.<name>`` labels
PARAMETERS = {"gamma": "weight", "beta": "bias", "embedding_table": "weight", "moving_mean": "running_mean",
              "moving_variance": "running_var"}


def canonical_api(prefix: str, api: str) -> tuple[str, str]:
    """(prefix, api) of a MindSpore API in PyTorch's terms; unknown prefixes stay."""
    if prefix == "Functional":
        functional = OPS_TO_FUNCTIONAL.get(api)
        return ("Functional", functional) if functional else ("Torch", api)
    return PREFIXES.get(prefix, prefix), api


def _cell_target(target: str) -> str:
    """``<path>.<Class>`` with the PyTorch class."""
    path, _, cls = target.rpartition(".")
    return f"{path}.{CELL_CLASSES.get(cls, cls)}" if path else CELL_CLASSES.get(cls, cls)


def canonical_name(name: str, framework: str) -> str:
    """The entry name PyTorch gives the same call (`name` itself for PyTorch dumps and names
    that do not parse)."""
    entry = parse_entry_name(name)
    if framework != MINDSPORE or entry is None:
        return name
    if entry.prefix == "Cell":
        target = _cell_target(entry.target)
        if entry.phase == "parameters_grad":
            return f"Module.{target}.parameters_grad" + ("" if entry.counter is None else f".{entry.counter}")
        return f"Module.{target}.{entry.phase}.{entry.counter}"
    if entry.prefix == "Primitive":
        return name
    prefix, api = canonical_api(entry.prefix, entry.target)
    return f"{prefix}.{api}.{entry.counter}.{entry.phase}"


def canonical_label(label: str, framework: str) -> str:
    """A tensor label (``parameters.gamma``, ``parameters_grad.beta.0``) with PyTorch's parameter names."""
    if framework != MINDSPORE:
        return label
    role, _, rest = label.partition(".")
    if role not in ("parameters", "parameters_grad"):
        return label
    param, dot, tail = rest.partition(".")
    return f"{role}.{PARAMETERS.get(param, param)}{dot}{tail}"


def canonical_names(names: list[str], framework: str) -> list[str]:
    """`canonical_name` of each name, kept unique: a name whose canonical form is already taken
    (``ops.relu`` and ``mint.nn.functional.relu`` in one dump both become ``Functional.relu``)
    keeps its own name."""
    taken: set[str] = set()
    result = []
    for name in names:
        canonical = canonical_name(name, framework)
        if canonical in taken:
            canonical = name
        taken.add(canonical)
        result.append(canonical)
    return result
