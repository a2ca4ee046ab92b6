"""ACL rules for the broker, written in EMQX's ``acl.conf`` syntax so that an EMQX user can bring their file.

Two modules, cut where the data changes hands: :mod:`.syntax` reads a file (tokens, Erlang terms, rules,
:class:`AclError` with ``file:line``) and knows nothing of matching; :mod:`.rules` is the parsed model and its
matching (clients, topic filters, placeholders, first-match decision) and knows nothing of the file format.
The broker checks every PUBLISH and SUBSCRIBE against :mod:`.rules` only; a second rule source (an admin API,
another syntax) would need only a second reader.
"""

from ecq.broker.acl.rules import Acl, ClientInfo, Decision
from ecq.broker.acl.syntax import AclError, load_acl, parse_acl

__all__ = ["Acl", "AclError", "ClientInfo", "Decision", "load_acl", "parse_acl"]
