"""The parts of the `Monitor` facade: the step's clock, the pipeline that turns a step's rows
into a decision and a record (transfer -> evaluate -> decide -> emit), the record emitter and
the replay driver."""
