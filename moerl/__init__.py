"""moerl: Megatron-core MoE reinforcement learning with SGLang engines."""

import warnings
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("moerl")
except PackageNotFoundError:  # run from a source tree that was never installed
    __version__ = "0+unknown"

# Messages megatron-core and torch print on every import or call in setups moerl supports on purpose
# (no Transformer Engine / Apex on CPU, megatron's own use of deprecated torch APIs). Hidden so that
# the warnings that remain are about the user's run.
for _message in (
    "Transformer Engine and Apex are not installed",
    "Apex is not installed",
    "full scope is deprecated",
    "`sequence_parallel` is set to `True`, but tensor model parallel size is 1",
    "When using sequence parallelism it is recommended to set the environment variable CUDA_DEVICE_MAX_CONNECTIONS",
    "Please use DTensor instead and we are deprecating ShardedTensor",
    "`load_state_dict` is deprecated",
    "`torch.distributed.reduce_scatter_tensor` is deprecated",
    "`torch.distributed.all_gather_into_tensor` is deprecated",
):
    warnings.filterwarnings("ignore", message=_message)
