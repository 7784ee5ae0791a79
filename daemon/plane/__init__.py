"""The event plane: rings, consumers, watermarks, the micro-batch planner and
its plan log, composed by ``EventPlane`` (``eventplane``)."""
