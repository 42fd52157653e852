"""logitserve client: reassembles sharded, chunked outputs into numpy arrays; needs grpcio, protobuf, numpy."""
from logitserve.tokens import tokenizer_hash

from .aio import AsyncTeacherClient
from .api import Detokenized, ModelInfo
from .assemble import Applied, ForwardResult, ModelIdentity
from .errors import LogitServeError, ReplicasDisagree
from .pool import AsyncTeacherPool
from .pool_sync import TeacherPool
from .routing import Routing
from .sync import TeacherClient
from .teachers import AsyncTeachers, RoutedResult, Teachers
from .wire import Wanted

__all__ = ["TeacherClient", "AsyncTeacherClient", "TeacherPool", "AsyncTeacherPool", "Routing", "LogitServeError",
           "ReplicasDisagree", "ForwardResult", "ModelInfo", "Detokenized",
           "Applied", "ModelIdentity", "Wanted", "tokenizer_hash", "Teachers", "AsyncTeachers", "RoutedResult"]
