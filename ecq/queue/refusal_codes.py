"""The MQTT 5 reason code of each refused ``$ECQ/`` write: one table for every place that answers a write.

``BadWrite.reason`` (``queue/topics.py``, ``queue/engine.py``, ``queue/rewind.py``, ``broker/writes.py``,
``store/protocol.QuotaExceeded``) names why ECQ refused a PUBLISH. MQTT 3.1.1 has no negative acknowledgement
(the write still gets its PUBACK or PUBREC); MQTT 5.0 section 3.4.2.1 (PUBACK) and 3.5.2.1 (PUBREC) give the
publisher a reason code of 0x80 or above, which :func:`write_refusal_code` picks from :data:`REFUSAL_CODES`.
"""

from __future__ import annotations

NOT_AUTHORIZED = 0x87
TOPIC_NAME_INVALID = 0x90
QUOTA_EXCEEDED = 0x97
PAYLOAD_FORMAT_INVALID = 0x99
UNSPECIFIED_ERROR = 0x80

# BadWrite.reason -> PUBACK/PUBREC reason code (MQTT 5.0 section 3.4.2.1, the same codes in 3.5.2.1).
# A payload above max_payload_bytes gets 0x97 "Quota exceeded" (an administrative limit), not 0x95 "Packet too
# large": section 3.4.2.1 does not list 0x95 for PUBACK or PUBREC (only CONNACK and DISCONNECT carry it), and
# paho-mqtt 2.2.0 raises ValueError on such a PUBACK. The Reason String tells it from a full queue.
REFUSAL_CODES: dict[str, int] = {
    "acl_denied": NOT_AUTHORIZED,
    "not_owner": NOT_AUTHORIZED,
    "quota_exceeded": QUOTA_EXCEEDED,
    "store_full": QUOTA_EXCEEDED,
    "payload_too_large": QUOTA_EXCEEDED,
    "bad_clientid": TOPIC_NAME_INVALID,
    "bad_key": TOPIC_NAME_INVALID,
    "empty_clientid": TOPIC_NAME_INVALID,
    "empty_key": TOPIC_NAME_INVALID,
    "not_a_write": TOPIC_NAME_INVALID,
    "bad_rewind": PAYLOAD_FORMAT_INVALID,
}


def write_refusal_code(reason: str) -> int:
    """The MQTT 5 PUBACK/PUBREC reason code (0x80..0xFF) for a ``BadWrite.reason``; 0x80 Unspecified error for a
    reason the table does not know (MQTT 5.0 section 3.4.2.1)."""
    return REFUSAL_CODES.get(reason, UNSPECIFIED_ERROR)
