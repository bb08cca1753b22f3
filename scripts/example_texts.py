"""The texts the example notebooks read (``scripts/make_examples.py`` builds them)."""

NOTES = """\
Meeting notes, library systems group.
The catalogue search is slow in the afternoons because every query re-reads the
whole subject index from disk. Priya measured 2.4 seconds per search at 3 pm and
0.3 seconds at 8 am. The index is 600 megabytes and the server has 16 gigabytes
of memory, most of it unused. Tom suggested keeping the index in memory and
writing a copy to the local SSD every night, so that a restart does not start
cold. Ana asked what happens if the server crashes in the middle of that copy;
Tom said the copy is written to a temporary file and then renamed, so the old
copy stays valid. The group agreed to try it for two weeks and compare the
search times before and after."""


DOCUMENT = """\
Harbor Street tide-gauge station: operations notes

The Harbor Street station has measured the water level of the inner harbor
since 1978. It stands at the end of the old ferry pier, on a concrete pile
cap, and consists of a stilling well, a radar sensor mounted above it, a
pressure sensor at the bottom of the well as a backup, and a small cabinet
with the logger, a cellular modem and two batteries charged by a solar panel.

The radar sensor reports the distance to the water surface every second. The
logger averages those readings over six minutes and stores one value per
interval, so a day has 240 values. The averaging removes the short waves made
by passing boats but keeps the tide and any storm surge. The backup pressure
sensor is read on the same schedule; when the two sensors disagree by more
than 3 centimeters for an hour, the logger raises a flag and the technician on
duty gets a text message.

Levels are reported relative to a chart datum, the lowest astronomical tide,
which lies 1.92 meters below the benchmark bolt set in the pier in 1978. Every
spring a surveyor levels from the benchmark to the sensor mount and writes the
offset into the logger configuration, which looks like this:
{"interval_s": 360, "datum": "LAT", "offset_m": 1.92, "alarm_cm": 3}

Data leaves the station twice an hour. The modem sends the newest values to
the harbor office server, which publishes them on the public website and keeps
the full record. If the cellular network is down, the logger keeps up to 90
days of values and sends the backlog when the connection returns; nothing has
been lost that way since the logger was replaced in 2016.

Maintenance follows a fixed calendar. Every month a technician cleans the solar
panel, checks the battery voltage, and compares a manual tape reading with the
radar value; the two must agree within one centimeter. Every three months the
stilling well is flushed, because silt collects at the bottom and can block the
intake holes, which makes the well respond slowly to the tide. Every year the
pressure sensor is taken out and calibrated in the workshop.

The station's record shows the harbor's slow change. The yearly mean level has
risen by about 9 centimeters since 1978. The highest level ever recorded was
2.87 meters above datum, during the storm of January 2007, when the surge added
almost a meter to a spring tide. The lowest was 0.31 meters below datum during
an offshore gale in 1996 that pushed water out of the bay.

Questions about the data go to the harbor office. Requests for the full record
are answered within a week, and the data is free for research and teaching.
"""
