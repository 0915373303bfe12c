"""Launch order between the layer's kernels on one stream."""
import cuda.tile as ct


def after_previous_kernel():
    """Wait until the kernel before this one on the stream has finished and its writes are
    visible, then let the next kernel start launching. Without programmatic stream
    serialization (PDL) at launch both are no-ops: the stream already orders the kernels.
    With it, the next kernel's launch overlaps this one, and this one's the previous."""
    ct.grid_dependency_control_wait()
    ct.grid_dependency_control_launch_dependents()
