"""The one exception type that bad graph input raises."""


class OpError(ValueError):
    """A shape, type, bounds or index rule of an op was broken.

    The message names the op, the tensors involved and the rule, e.g.
    ``SET_ROWS 'slots': index 7 in 'slot_order' is out of range [0, 4)``.
    """
