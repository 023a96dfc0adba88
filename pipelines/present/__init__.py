"""How figures reach people: units, colours and one-line summaries (formats.py), the console's and the
report's tables (console.py, tables.py), the charts (charts.py) and the report (report.py).

It imports pipelines/core/ and eval/; the report logs through the tracker protocol of pipelines/core/.
"""
