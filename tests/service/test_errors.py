"""The service's errors are one closed list of kinds (service/ground/errors.py), and each transport maps every kind
in one table of its own: HTTP's statuses, gRPC's codes, the engine's wire (by code). A kind added without a
choice in each table fails here, not in a client's hands."""
from __future__ import annotations

import grpc

from vitserve.service.engine.messages import Failure, error_of, failure_for
from vitserve.service.ground import errors
from vitserve.service.grpc.servicer import GRPC_CODES, grpc_code
from vitserve.service.http.errors import STATUS_CODES, status_code


def all_kinds(base=errors.ServiceError) -> list[type[errors.ServiceError]]:
    return [base, *(kind for sub in base.__subclasses__() for kind in all_kinds(sub))]


def test_every_kind_has_its_own_code():
    kinds = all_kinds()
    assert len(kinds) == len({kind.code for kind in kinds}) == len(errors.KINDS) > 20
    assert all(errors.KINDS[kind.code] is kind for kind in kinds)


def test_each_transport_maps_every_kind():
    assert set(STATUS_CODES) == set(GRPC_CODES) == set(errors.KINDS.values())


def test_the_engine_wire_gives_back_the_same_kind_and_message():
    for kind in errors.KINDS.values():
        back = error_of(failure_for(7, kind("why it failed")))
        assert type(back) is kind and str(back) == "why it failed"
        assert (status_code(back), grpc_code(back)) == (STATUS_CODES[kind], GRPC_CODES[kind])


def test_an_unknown_code_on_the_wire_is_the_base_kind():
    back = error_of(Failure(7, "from_a_newer_engine", "x"))
    assert type(back) is errors.ServiceError and (status_code(back), grpc_code(back)) == (500, grpc.StatusCode.INTERNAL)
