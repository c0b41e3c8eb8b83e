"""The errors a checkpoint can raise while it is read (every reader and parser uses these)."""


class CheckpointError(ValueError):
    """A checkpoint folder, its config or one of its tensors is missing or malformed.

    The message names the file and the tensor or field at fault, and what was expected.
    """


class QuantizationError(CheckpointError):
    """A quantization_config (or a quantized tensor) moeserve does not serve, said by name."""
