"""One adapter per benchmarked system. Each runs inside `bench/worker.py`, in the virtual
environment its system needs; none of them may import another system's packages."""

SYSTEMS: dict[str, str] = {
    "tensorbroker": "systems.tb:TensorBroker",
    "plasma": "systems.plasma_store:Plasma",
    "ray": "systems.ray_store:Ray",
    "torch_queue": "systems.queues:TorchQueue",
    "mp_queue": "systems.queues:MpQueue",
    "zmq_pickle5": "systems.zmq_pickle:ZmqPickle5",
    "zmq_floor": "systems.floors:ZmqFloor",
    "copyto_floor": "systems.floors:CopytoFloor",
}
