"""Every configuration rule of global-batch packing, each written once.

``values`` holds the value rules the others are built from (one positive int, one power of two, one switch),
``model`` the rules of a model config that a step checks on every rank and validation checks before training,
``container`` the rules of Megatron-Bridge's ``ConfigContainer`` (:func:`packing.config.validate_global_batch_packing`).
Rules that depend on the pin read the generation table or the detected capabilities; rules raise
:class:`~mcore_compat.errors.PackingConfigError` naming the field, its value and the fix.
"""

from mcore_compat.rules.model import *  # noqa: F403 - the package is the rules' one namespace
from mcore_compat.rules.model import __all__ as _model_all
from mcore_compat.rules.values import *  # noqa: F403
from mcore_compat.rules.values import __all__ as _values_all

__all__ = [*_model_all, *_values_all]
