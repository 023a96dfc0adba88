"""How figures reach people: units, colours and one-line summaries (formats.py), the console's and the
report's tables (console.py, report_tables.py), the charts (charts.py), the report (report.py) and the speed
half's report (speed_half.py).

It imports pipelines/core/ and eval/; the report logs through the tracker protocol of pipelines/core/.
"""
