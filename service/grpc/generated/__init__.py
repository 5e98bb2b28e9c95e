"""Triton's gRPC protocol (package `inference`): the .proto files as published, and the stubs `make grpc-stubs`
made from them."""
