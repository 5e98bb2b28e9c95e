"""The Open Inference Protocol over gRPC: the servicer on grpcio's asyncio server, the protobuf's conversions, and the
checked-in stubs generated from Triton's .proto files (generated/)."""
