"""The descriptor pool that holds Triton's ``inference`` package for gepool's gRPC service.

Kept apart from protobuf's default pool: tritonclient registers ``inference.ModelConfig`` and the
rest there from its own files, and a second registration of the same names in one process fails.
"""

from google.protobuf import descriptor_pool

POOL = descriptor_pool.DescriptorPool()
