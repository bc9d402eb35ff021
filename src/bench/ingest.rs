//! `ingest`: the event-bus against a minimal hyper + async-nats forwarder, in one run, over
//! HTTP/1.1 and h2c: what eddy's publish path costs beyond storing the event.

use super::{LoadFlags, json, load, print_rates, show_spread, spread, write_json};

pub(super) async fn ingest(flags: &LoadFlags, batch: usize) -> anyhow::Result<()> {
    let (rounds, rss) = load::ingest(&flags.load_args(), batch).await?;
    let batched = if batch > 1 {
        format!(", batches of {batch} (latency per batch)")
    } else {
        String::new()
    };
    let protocol = if flags.http2 { "HTTP/2" } else { "HTTP/1.1" };
    println!(
        "ingest: {} B events, {} {}, {:?} each, {} rounds{batched}",
        flags.size,
        flags.connections,
        if flags.http2 {
            "streams on one HTTP/2 connection"
        } else {
            "connections"
        },
        flags.duration,
        rounds.len()
    );
    let mut to_forwarder = Vec::new();
    let mut to_raw = Vec::new();
    let mut cpu_to_forwarder = Vec::new();
    for (index, round) in rounds.iter().enumerate() {
        let mut rates = vec![&round.event_bus];
        rates.extend(round.forwarder.as_ref());
        rates.push(&round.raw);
        print_rates(&format!("round {}", index + 1), &rates);
        let bus = round.event_bus.per_second;
        if let Some(forwarder) = &round.forwarder {
            to_forwarder.push(bus / forwarder.per_second.max(1e-9));
        }
        print!("CPU per event: event-bus {:.1} µs", round.event_bus_cpu_us);
        if let Some(forwarder_cpu) = round.forwarder_cpu_us {
            print!(", forwarder {forwarder_cpu:.1} µs");
            cpu_to_forwarder.push(round.event_bus_cpu_us / forwarder_cpu.max(1e-9));
        }
        println!();
        to_raw.push(bus / round.raw.per_second.max(1e-9));
    }
    let to_forwarder = (!to_forwarder.is_empty()).then(|| spread(&to_forwarder));
    let cpu_to_forwarder = (!cpu_to_forwarder.is_empty()).then(|| spread(&cpu_to_forwarder));
    let to_raw = spread(&to_raw);
    if let Some(ratio) = &to_forwarder {
        println!("event-bus / forwarder ({protocol}): {}", show_spread(ratio));
    }
    if let Some(ratio) = &cpu_to_forwarder {
        println!(
            "event-bus CPU per event / forwarder's: {}",
            show_spread(ratio)
        );
    }
    println!("event-bus / raw: {}", show_spread(&to_raw));
    println!("event-bus peak RSS: {rss:.1} MiB");
    write_json(
        flags.out.as_ref(),
        &json!({"scenario": if batch > 1 { "ingest-batch" } else { "ingest" }, "size": flags.size,
            "connections": flags.connections, "http2": flags.http2, "batch": batch,
            "rounds": rounds, "eventBusToForwarder": to_forwarder, "eventBusToRaw": to_raw,
            "eventBusCpuToForwarder": cpu_to_forwarder,
            "eventBusPeakRssMiB": rss}),
    )
}
